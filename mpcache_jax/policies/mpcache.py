"""MPCache: look-once static eviction at prefill + hierarchical clustered dynamic selection.

Static eviction (paper Section 4.2): the last `window_ratio` of prompt queries vote with their
attention; per layer (shared by its heads, or per KV head) the top `static_keep` tokens stay.
Dynamic selection (Section 4.3), every decode step: the kept tokens are grouped into clusters
of adjacent tokens, selected coarse to fine; the first (sink) and last (most recent) clusters
are always selected; all selections and gathers are masks and one-hot matmuls.
Cross-layer index sharing (Section 4.4): a selecting layer's choice is reused by the next
`share_group - 1` layers; layers below `share_from` always select for themselves.

Two configurations are registered (policies/__init__.py):
- `mpcache` (the class defaults): what the fidelity suite (experiments/natural_tasks.py,
  WORKSPACE.md "Fidelity") showed to keep natural-text answers. No static eviction (on
  SmolLM2 the prompt's last queries vote against answer tokens: at a 50% keep only ~20% of
  an answer's tokens survive); a cluster scores its best token's q . k, read from the
  step's own attention scores (the quantity the paper's bounding boxes approximate:
  `similarity="exact"`; cos(q, k) instead on models with QK-norm, `token_score="auto"`),
  a token scoring its best query head of the GQA group
  (`group_reduce="max"`: with the group's summed logits selection kept less of the answer
  span and mostly agreed less with `full`, WORKSPACE.md "The GQA group's best head"); every layer
  selects (sharing across layers costs 4-8x the KL on SmolLM2); clusters of 16 (the best
  20% kept) then 4 tokens; one selection per KV head on models with few KV heads
  (`select_scope="auto"`: SmolLM2's 3 raise the agreement with `full` from 0.39 to 0.58 for
  1.4x the selection's bytes), one per layer shared by its heads otherwise (per-head
  selection multiplies the top-k and one-hots by the KV heads: unaffordable under MPC on a
  32-KV-head model). The coarse level hands the finest at least twice the budget
  (`oversample`): at budgets of 20% and more its 20% ratio alone left the 4-token level no
  choice, and selection fell back to whole 16-token clusters.
- `mpcache_paper`: the authors' hyperparameters (their LongBench setting).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax import extent as E
from mpcache_jax import primitives as P
from mpcache_jax.cache import append_token
from mpcache_jax.policies.base import (PromptEvictionPolicy, PrunedLayer, WorkingSet,
                                       attend_selected, attend_with_new, attend_working_set,
                                       empty_working_set, gather_working_set, new_region,
                                       prompt_kv, window_attention_mass)

SIMILARITIES = ("exact", "alpha", "mp", "avg")
TOKEN_SCORES = ("auto", "dot", "cosine", "projection")
SELECT_SCOPES = ("auto", "layer", "head")
# select_scope="auto" selects per KV head on models with at most this many KV heads, else once
# per layer: the selection's top-k and one-hots scale with the rows that select. Measured:
# SmolLM2-135M (3 KV heads, T = 1024, 2 layers, ABY3): per head 14.40 MB vs per layer
# 10.18 MB vs `full` 19.77 MB, and agreement with `full` 0.58 vs 0.39 on the fidelity suite;
# llama2-d1024 (32 KV heads) keeps the per-layer selection (WORKSPACE.md "Fidelity").
AUTO_HEAD_MAX_KV_HEADS = 4
STATIC_SCOPES = ("layer", "head", "model")


def _is_ratio_or_count(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    return isinstance(value, float) and 0.0 < value <= 1.0


@dataclasses.dataclass(frozen=True)
class MPCache(PromptEvictionPolicy):
    """MPCache and, through its switches, every ablation of the paper's Figure 11.

    budget: prompt tokens attended per decode step (ratio of the prompt or a count).
    static: evict prompt tokens once at prefill (the paper); static_keep: tokens it keeps
      (ratio or count); None = max(25% of the prompt, 2 x budget).
    static_window: the last prompt queries that vote (ratio of the prompt, or a count).
    static_scope: "layer" (one kept set per layer, shared by its heads: the paper), "head" (per
      KV head) or "model" (one set for every layer, from the votes summed over layers).
    static_cluster: static eviction keeps whole clusters of this many adjacent tokens, each
      scored by its strongest token (1 = token level, as the paper).
    levels: ((cluster_size, keep_ratio), ..., (finest_size, None)) coarse to fine; each level
      keeps at least keep_ratio of its valid clusters and enough for the next level; the last
      level selects the final budget. Sizes must divide each other (coarse >= fine).
    oversample: each coarser level also keeps at least oversample x the budget in tokens, so
      the finest level always chooses among that many times what it keeps (without it a fixed
      keep_ratio at or below the budget leaves the finer levels nothing to choose). 0 = only
      the keep ratios and the finer level's needs (the paper's rule).
    similarity: "exact" (a cluster's best q . k, from the step's attention scores), "alpha"
      (q . (alpha r_max + (1 - alpha) r_min), the paper), "mp" (the exact upper bound
      sum_i max(q_i r_max_i, q_i r_min_i)) or "avg" (the cluster mean).
    token_score: what the "exact" similarity reads per token: "dot" (the step's attention
      score q . k), "cosine" (q . k / (|q| |k|): direction only, as `longcache` scores; the
      prompt keys' inverse norms are computed once at prefill, the step divides by its
      queries' norms and multiplies by the keys' inverse norms elementwise) or "projection"
      (q . k / |q|: the key's length along the query, so that the query heads of a group
      compare on one scale while a key's norm still counts). "auto": "cosine" on models whose
      keys are RMS-normalized per head (QK-norm, `PrefillAux.normalized_keys`: Gemma 3), where
      a key's norm is a learned scale's and the dot product misled the selection at 8192
      tokens; "dot" otherwise (SmolLM2, where the cosine lost; docs/models.md "Fidelity from
      2048 to 32768 tokens"). Decided at prefill: a cosine layer carries its keys' inverse
      norms as `extras`.
    group_reduce: how the query heads of one KV head (a GQA group) combine their scores of a
      token ("exact" only): "sum" (their summed q . k) or "max" (the best head's: a token one
      head needs is not outvoted by the others). A per-layer selection then sums over KV heads.
      With the cosine on Gemma the sum is better at a 20% budget (at 8192 tokens its agreement
      with `full` is within 0.02 of `longcache`'s, the max's 0.13 below) and the max at 5-10%
      (lower KL, and at 2048 tokens more agreement): docs/models.md, "the group max".
    select_scope: "layer" (one selection for all the layer's heads, scores summed over them),
      "head" (one per KV head, the paper) or "auto" (per head on models with at most
      AUTO_HEAD_MAX_KV_HEADS KV heads, else per layer: `scope_for`).
    share_group, share_from: cross-layer index sharing (1 = every layer selects).
    refresh_every: select anew every this many decode steps (the first decode step always
      selects). 1 = every step, picking the selected clusters' attention scores out of scores
      over the whole region. Above 1 a selection gathers the chosen tokens' keys and values
      into a compact `WorkingSet`, and the steps until the next selection attend to it and the
      generated tokens only: their cost follows the budget, not the cache. The schedule is
      public (it counts generated tokens), so it reveals nothing.
    """

    # A family of its own (it uses PromptEvictionPolicy's finer hooks: keep_mask, compress,
    # attend, ...): its registered variants differ in settings, not in code.
    REQUIRED_HOOKS = ()
    HOOKS = ()

    name: str = "mpcache"
    needs_queries: bool = True    # set from `static` (only static eviction votes with them)
    topk_method: str = "rank"
    static_keep: float | int | None = None
    static: bool = False
    dynamic: bool = True
    static_window: float | int = 0.2
    static_cluster: int = 1
    static_reduce: str = "sum"
    static_sinks: int = 16
    static_recent: int = 32
    static_scope: str = "layer"
    levels: tuple = ((16, 0.2), (4, None))
    oversample: float = 2.0
    similarity: str = "exact"
    token_score: str = "auto"
    alpha: float = 0.6
    group_reduce: str = "max"
    select_scope: str = "auto"
    share_group: int = 1
    share_from: int = 2
    share_static: bool = True
    refresh_every: int = 1

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "needs_queries", bool(self.static))
        if self.layer_budget is not None and (self.dynamic or not self.static):
            raise ValueError("a layer_budget needs static eviction only (static=True, "
                             "dynamic=False): dynamic selection assumes one budget per layer")
        if (isinstance(self.refresh_every, bool) or not isinstance(self.refresh_every, int)
                or self.refresh_every < 1):
            raise ValueError(f"refresh_every={self.refresh_every!r} must be an integer >= 1 "
                             "(decode steps between two selections; 1 = select at every step)")
        if self.refresh_every > 1 and not self.dynamic:
            raise ValueError("refresh_every > 1 reuses a dynamic selection; static-only MPCache "
                             "(dynamic=False) has none: leave refresh_every at 1")
        if not (self.static or self.dynamic):
            raise ValueError("MPCache needs static or dynamic eviction (or both); for no eviction "
                             "use the 'full' policy")
        if self.static_keep is not None and not _is_ratio_or_count(self.static_keep):
            raise ValueError(f"static_keep={self.static_keep!r} must be a ratio in (0, 1], a "
                             "token count >= 1, or None for the default")
        if self.static_reduce not in ("sum", "max"):
            raise ValueError(f"static_reduce={self.static_reduce!r}; use 'sum' (accumulated "
                             "attention, as the paper) or 'max' (strongest single vote)")
        if self.static_scope not in STATIC_SCOPES:
            raise ValueError(f"static_scope={self.static_scope!r}; use one of {STATIC_SCOPES}: one "
                             "kept set per layer (the paper), per KV head, or one for the whole model")
        if self.static_sinks < 0 or self.static_recent < 0:
            raise ValueError("static_sinks and static_recent must be >= 0")
        if not _is_ratio_or_count(self.static_window):
            raise ValueError(f"static_window={self.static_window!r} must be a ratio in (0, 1] of "
                             "the prompt or a count >= 1 of its last queries")
        if not isinstance(self.static_cluster, int) or self.static_cluster < 1:
            raise ValueError(f"static_cluster={self.static_cluster!r} must be a positive integer "
                             "(1 = token-level static eviction)")
        if not self.levels:
            raise ValueError("levels must hold at least one (cluster_size, keep_ratio) pair")
        sizes = [lv[0] for lv in self.levels]
        for i, level in enumerate(self.levels):
            if len(level) != 2:
                raise ValueError(f"level {i} = {level!r} must be a (cluster_size, keep_ratio) pair")
            size, keep = level
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"cluster size {size!r} at level {i} must be a positive integer")
            if i == len(self.levels) - 1:
                if keep is not None:
                    raise ValueError("the last level selects the final budget: give its keep "
                                     f"ratio as None, not {keep!r}")
            elif not (isinstance(keep, float) and 0.0 < keep <= 1.0):
                raise ValueError(f"keep ratio {keep!r} at level {i} must be a float in (0, 1]")
            if i and (sizes[i] > sizes[i - 1] or sizes[i - 1] % sizes[i]):
                raise ValueError(f"cluster sizes must go coarse to fine, each dividing the one "
                                 f"before: got {sizes}")
        if (isinstance(self.oversample, bool) or not isinstance(self.oversample, (int, float))
                or not (self.oversample == 0 or self.oversample >= 1)):
            raise ValueError(f"oversample={self.oversample!r} must be 0 (off) or >= 1: the "
                             "finest level cannot choose its budget among fewer tokens")
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"similarity={self.similarity!r}; use one of {SIMILARITIES}")
        if self.token_score not in TOKEN_SCORES:
            raise ValueError(f"token_score={self.token_score!r}; use one of {TOKEN_SCORES}")
        if self.token_score in ("cosine", "projection") and self.similarity != "exact":
            raise ValueError(f"token_score={self.token_score!r} scores single tokens: it needs "
                             f"similarity='exact', not {self.similarity!r}")
        if self.group_reduce not in ("sum", "max"):
            raise ValueError(f"group_reduce={self.group_reduce!r}; use 'sum' or 'max'")
        if self.select_scope not in SELECT_SCOPES:
            raise ValueError(f"select_scope={self.select_scope!r}; use 'layer' (one selection "
                             "per layer), 'head' (one per KV head) or 'auto'")
        if self.select_scope == "layer" and self.static and self.static_scope == "head":
            raise ValueError("static_scope='head' keeps different tokens per head: select per "
                             "head too (select_scope='head')")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} must be in [0, 1]")
        if self.share_group < 1 or self.share_from < 0:
            raise ValueError(f"share_group={self.share_group} must be >= 1 and share_from="
                             f"{self.share_from} >= 0 (share_group=1 disables sharing)")
        finest = sizes[-1]
        if self.dynamic and isinstance(self.budget, int) and self.budget < 2 * finest:
            raise ValueError(f"budget={self.budget} tokens cannot hold the 2 always-selected "
                             f"clusters of {finest} tokens; raise the budget or use a smaller "
                             "finest cluster size")

    # --- sizes -----------------------------------------------------------------------------
    @property
    def sizes(self) -> list[int]:
        return [lv[0] for lv in self.levels]

    @property
    def reuses(self) -> bool:
        """Whether decode steps reuse a gathered working set between selections."""
        return self.dynamic and self.refresh_every > 1

    @property
    def static_per_head(self) -> bool:
        """Whether static eviction keeps a different slot set per KV head (else every head of a
        layer has the same valid slots)."""
        return self.static and self.static_scope == "head"

    def scope_for(self, num_kv_heads: int) -> str:
        """"layer" or "head": the selection scope on a model with this many KV heads (static
        eviction per KV head always selects per head)."""
        if self.select_scope != "auto":
            return self.select_scope
        if self.static_per_head or num_kv_heads <= AUTO_HEAD_MAX_KV_HEADS:
            return "head"
        return "layer"

    def selects(self, layer: int) -> bool:
        """Whether `layer` runs its own selection (otherwise it reuses the previous one).
        Without sharing every layer selects (also when the layer loop traces the index)."""
        if self.share_group == 1:
            return True
        return layer < self.share_from or (layer - self.share_from) % self.share_group == 0

    def kept_count(self, prompt_len: int) -> int:
        B = P.budget_tokens(self.budget, prompt_len)
        if not self.static:
            return prompt_len
        if not self.dynamic:
            target = B
        elif self.static_keep is None:
            target = min(prompt_len, max(math.ceil(0.25 * prompt_len), 2 * B))
        else:
            target = max(B, P.budget_tokens(self.static_keep, prompt_len))
        if self.static_cluster == 1:
            return target
        # Whole clusters: the last (partial) cluster is always kept; static-only rounds down so
        # decoding never exceeds the budget, otherwise round up to give selection room.
        s, last = self.static_cluster, self._last_cluster_size(prompt_len)
        full = max(0, target - last)
        full = full // s if not self.dynamic else math.ceil(full / s)
        return min(prompt_len, full * s + last)

    def _last_cluster_size(self, prompt_len: int) -> int:
        return prompt_len - (math.ceil(prompt_len / self.static_cluster) - 1) * self.static_cluster

    def region_capacity(self, prompt_len: int, count: int) -> int:
        if not self.dynamic:
            return count
        return math.ceil(count / self.sizes[0]) * self.sizes[0]

    def level_counts(self, kept: int, budget: int) -> list[int]:
        """Clusters selected at each level for `kept` prompt tokens and a `budget` in tokens."""
        sizes = self.sizes
        valid = [math.ceil(kept / s) for s in sizes]
        last = valid[-1] if budget >= kept else budget // sizes[-1]
        if last < min(2, valid[-1]):
            raise ValueError(f"a budget of {budget} tokens cannot hold the 2 always-selected "
                             f"clusters of {sizes[-1]} tokens; raise the budget or use a smaller "
                             "finest cluster size")
        wide = self.oversample * budget if budget < kept else 0   # tokens handed down, at least
        counts = [0] * len(sizes)
        counts[-1] = last
        for i in range(len(sizes) - 2, -1, -1):
            r = sizes[i] // sizes[i + 1]
            pad = r * valid[i] - valid[i + 1]   # empty children, all in the last cluster
            need = math.ceil((counts[i + 1] + pad) / r)
            keep = math.ceil(self.levels[i][1] * valid[i])
            counts[i] = min(valid[i], max(keep, need, math.ceil(wide / sizes[i]), min(2, valid[i])))
        return counts

    def ranked_rows(self, prompt_len: int, num_kv_heads: int) -> tuple[int, int]:
        """(rows, candidates of the longest row) that one layer's selection ranks for a prompt
        of prompt_len tokens: level 0 ranks every cluster of the region, a finer level the
        children of the clusters chosen above (`select`). Cost runs pick the top-k method
        from it (pairwise rank is O(rows x candidates^2) work)."""
        sizes, kept = self.sizes, self.kept_count(prompt_len)
        counts = self.level_counts(kept, P.budget_tokens(self.budget, prompt_len))
        region = self.region_capacity(prompt_len, kept)
        longest = max([math.ceil(region / sizes[0])] + [
            counts[i - 1] * (sizes[i - 1] // sizes[i]) for i in range(1, len(sizes))])
        return (1 if self.scope_for(num_kv_heads) == "layer" else num_kv_heads), longest

    def check_prompt(self, prompt_len: int) -> None:
        if self.static and self.static_cluster > 1:
            s = self.static_cluster
            kept = self.kept_count(prompt_len)
            forced = int(self._cluster_forced(prompt_len, kept).sum())
            if kept < prompt_len and forced > math.ceil(kept / s):
                raise ValueError(
                    f"static eviction keeps {kept} tokens = {math.ceil(kept / s)} clusters of {s}, "
                    f"fewer than the {forced} clusters holding the {self.static_sinks} sink and "
                    f"{self.static_recent} recent tokens; raise the budget/static_keep or lower "
                    "static_sinks/static_recent/static_cluster")
        if self.dynamic:
            self.level_counts(self.kept_count(prompt_len), P.budget_tokens(self.budget, prompt_len))
        if self.reuses and isinstance(self.budget, int) and self.budget > prompt_len:
            raise ValueError(f"budget={self.budget} tokens: a working set larger than the "
                             f"prompt's {prompt_len} tokens; lower the budget (or give a ratio)")

    # --- the decode cache ------------------------------------------------------------------
    def prompt_keep(self, cache, aux):
        if self.static:
            return super().prompt_keep(cache, aux)
        extent = E.of(aux)   # nothing is evicted: every real prompt token stays
        return [(jnp.asarray(extent.valid()),) + self.layer_count(extent, len(cache), index)
                for index in range(len(cache))]

    def compress(self, cache, aux, max_new_tokens: int):
        if self.static:
            layers = super().compress(cache, aux, max_new_tokens)
        else:
            # The prompt region is the dense prefill cache as it is (padded to whole coarse
            # clusters): no votes and no compaction, whose one-hot over a bucket's slots grows
            # with the square of the prompt.
            extent = E.of(aux)
            T = extent.capacity
            if extent.static:
                self.check_prompt(T)
            pad = self.region_capacity(T, T) - T
            valid = np.pad(np.ones(T, np.float32), (0, pad)) if extent.static else \
                jnp.pad(extent.valid(), (0, pad))
            layers = []
            for layer in cache:
                k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in prompt_kv(layer, T))
                region_valid = jnp.broadcast_to(jnp.asarray(valid, k.dtype), k.shape[:2])
                layers.append(PrunedLayer(
                    k, v, region_valid, new_region(layer, max_new_tokens),
                    self.layer_extras(k, region_valid), prompt_len=T, kept=T,
                    length=None if extent.static else extent.length, low=extent.low))
            layers = tuple(layers)
        if self.uses_cosine(aux):
            # [H_kv, S]; an empty slot's large value is removed by its validity mask
            layers = tuple(layer.replace(extras=P.inverse_norms(layer.k)) for layer in layers)
        if not self.reuses:
            return layers
        return tuple(layer.replace(working=self._empty_working_set(layer)) for layer in layers)

    def uses_cosine(self, aux) -> bool:
        """Whether this prompt's selection scores tokens by cos(q, k) (`token_score`)."""
        if not self.dynamic or self.similarity != "exact":
            return False
        return self.token_score == "cosine" or (self.token_score == "auto"
                                                and bool(aux.normalized_keys))

    def _empty_working_set(self, state: PrunedLayer) -> WorkingSet:
        Hkv, _, d = state.k.shape
        _, bounds, _ = self.selection_counts(state.extent())
        rows = 1 if self.scope_for(Hkv) == "layer" else Hkv
        return empty_working_set(Hkv, rows, bounds[-1] * self.sizes[-1], d, state.k.dtype)

    # --- static eviction -------------------------------------------------------------------
    def vote_window(self, prompt_len: int) -> int:
        return min(prompt_len, P.budget_tokens(self.static_window, prompt_len))

    def _vote(self, q, k, extent: E.Extent):
        """Attention mass [H_kv, T] the voting window gives each prompt token."""
        key = (self, "vote_window")
        return jnp.sum(window_attention_mass(
            q, k, extent.count(self.vote_window, key), self.static_reduce, extent=extent,
            window_max=extent.bound(self.vote_window, key)), axis=1)

    def compress_carry(self, cache, aux):
        if not self.static or self.static_scope != "model":
            return None
        extent = E.of(aux)
        T = extent.capacity
        if aux.queries is None or (extent.static and self.kept_count(T) == T):
            return None
        return sum(jnp.sum(self._vote(q, layer.k[:, :T], extent), axis=0)
                   for q, layer in zip(aux.queries, cache))

    def keep_scores(self, layer, q, k, extent, carry):
        if self.static_scope == "model":
            return carry, carry
        if self.share_static and not self.selects(layer) and carry is not None:
            return carry, carry
        mass = self._vote(q, k, extent)
        scores = mass if self.static_scope == "head" else jnp.sum(mass, axis=0)
        return scores, scores

    def forced_keep(self, extent, count):
        """The first `static_sinks` and last `static_recent` prompt tokens always survive
        static eviction (the static counterpart of the always-selected first/last clusters)."""
        lo = jnp.minimum if not extent.static else min
        sinks = lo(self.static_sinks, count)
        recent = lo(self.static_recent, count - sinks)
        return E.union(E.iota_lt(extent.capacity, sinks), extent.last_tokens(recent))

    def keep_mask(self, layer, q, k, extent, count, bound, forced, carry):
        """Token-level top-k, or (static_cluster > 1) the top whole clusters by their strongest
        token, expanded back to tokens with a public membership matmul."""
        s = self.static_cluster
        if s == 1:
            return super().keep_mask(layer, q, k, extent, count, bound, forced, carry)
        scores, carry = self.keep_scores(layer, q, k, extent, carry)
        T = extent.capacity
        C = math.ceil(T / s)
        pad = [(0, 0)] * (scores.ndim - 1) + [(0, C * s - T)]
        cluster_scores = jnp.max(jnp.pad(scores, pad).reshape(*scores.shape[:-1], C, s), axis=-1)
        # (n - 1) full clusters + the partial last one; the clusters holding a forced token
        # and the last (partial) cluster are always kept.
        chosen_fn = lambda t: math.ceil(self.kept_count(t) / s)
        last_fn = lambda t: math.ceil(t / s) - 1
        n_clusters = extent.count(chosen_fn, (self, "static_clusters"))
        last = extent.count(last_fn, (self, "last_cluster"))
        if extent.static:
            cluster_forced, valid = self._cluster_forced(T, count), None
        else:
            padded = jnp.pad(jnp.asarray(forced), (0, C * s - T))
            cluster_forced = jnp.maximum(jnp.max(padded.reshape(C, s), axis=1), E.at(C, last))
            valid = E.iota_lt(C, last + 1)
        chosen = P.topk_mask(cluster_scores, n_clusters, forced=cluster_forced, valid=valid,
                             method=self.topk_method,
                             k_max=extent.bound(chosen_fn, (self, "static_clusters")))
        membership = (np.arange(T)[None, :] // s == np.arange(C)[:, None])
        keep = chosen @ jnp.asarray(membership, chosen.dtype)
        return (keep if extent.static else keep * extent.valid()), carry

    def _cluster_forced(self, prompt_len: int, count: int) -> np.ndarray:
        """[C] 0/1: clusters holding a forced token, and always the last (partial) one."""
        s = self.static_cluster
        C = math.ceil(prompt_len / s)
        forced = np.pad(self.forced_keep(E.Extent(prompt_len, prompt_len), count),
                        (0, C * s - prompt_len))
        forced = forced.reshape(C, s).max(axis=1)
        forced[-1] = 1.0
        return forced

    def layer_extras(self, kept_k, valid):
        """Per-level cluster digests (bounding boxes or means), once per prompt. "exact" scores
        clusters with the step's own attention scores: none (`compress` adds the keys' inverse
        norms for the cosine token score)."""
        if not self.dynamic or self.similarity == "exact":
            return None
        digests = []
        for s in self.sizes:
            r_max, r_min = P.cluster_bounds(kept_k, s, valid)
            if self.similarity == "alpha":
                digests.append((self.alpha * r_max + (1.0 - self.alpha) * r_min,))
            elif self.similarity == "mp":
                digests.append((r_max, r_min))
            else:
                Hkv, S, d = kept_k.shape
                w = valid.reshape(Hkv, S // s, s, 1)
                total = jnp.sum(kept_k.reshape(Hkv, S // s, s, d) * w, axis=2)
                digests.append((total / jnp.maximum(jnp.sum(w, axis=2), 1.0),))
        return tuple(digests)

    # --- dynamic selection -----------------------------------------------------------------
    def _digest_scores(self, qg, digest):
        if self.similarity == "alpha":
            return P.cluster_scores(qg, digest[0], digest[0], mode="alpha", alpha=1.0)
        if self.similarity == "mp":
            return P.cluster_scores(qg, digest[0], digest[1], mode="mp")
        return P.cluster_scores(qg, digest[0], digest[0], mode="avg", mean=digest[0])

    def level_scores(self, qg, state: PrunedLayer, scores: jax.Array | None = None):
        """Per level, a function from candidate clusters (None: all of them; or the selection
        of the levels above as a chain of one-hots, whose picks' children are the candidates:
        `primitives.chain_pick`) to their scores [R, n]. R = H_kv (a selection per KV head), or
        1 (`select_scope="layer"`: one selection per layer, scores summed over its heads).

        "exact": a cluster's score is its best token's q . k, the quantity the paper's bounds
        approximate, read from `scores` ([H_kv, G, S]: the step's attention scores of the
        kept region, summed over the GQA group); "alpha" / "mp" / "avg": the digests'."""
        per_layer = self.scope_for(state.k.shape[0]) == "layer"
        Hkv, S, _ = state.k.shape
        if self.similarity != "exact":
            def digest_level(i):
                def level(child):
                    digest = state.extras[i]
                    if child is not None:
                        digest = tuple(P.chain_pick(child, part) for part in digest)
                    out = self._digest_scores(qg, digest)
                    return jnp.sum(out, axis=0, keepdims=True) if per_layer else out
                return level
            return [digest_level(i) for i in range(len(self.sizes))]
        if scores is None:
            scores = attention.grouped_scores(qg.reshape(-1, qg.shape[-1]), state.k)
        cosine = state.extras is not None      # compress decided (`uses_cosine`)
        if cosine or self.token_score == "projection":   # positive scalings per query head
            scores = scores * P.inverse_norms(qg)[..., None]
        reduce = jnp.max if self.group_reduce == "max" else jnp.sum
        token = reduce(scores, axis=1)                                        # [H_kv, S]
        if cosine:
            token = token * state.extras                                      # [H_kv, S]
        if per_layer:
            token = jnp.sum(token, axis=0, keepdims=True)
        valid = state.valid[:token.shape[0]]
        token = token * valid - P.EMPTY_BOUND * (1.0 - valid)                # [R, S]

        # Cluster maxima finest first, each coarser level from the one below: the comparison
        # tree is log2(coarsest size) deep for all levels together, and a finer level's
        # candidates gather their precomputed maxima (one one-hot product) instead of their
        # tokens to compare again.
        R, sizes = token.shape[0], self.sizes
        maxima = [jnp.max(token.reshape(R, S // sizes[-1], sizes[-1]), axis=-1)]   # [R, C_last]
        for i in range(len(sizes) - 2, -1, -1):
            finer = maxima[0]
            maxima.insert(0, jnp.max(finer.reshape(R, S // sizes[i], sizes[i] // sizes[i + 1]),
                                     axis=-1))                                     # [R, C_i]

        def exact_level(i):
            def level(child):
                if child is None:
                    return maxima[i]                                               # [R, C]
                return P.chain_pick(child, maxima[i][..., None])[..., 0]           # [R, n]
            return level
        return [exact_level(i) for i in range(len(sizes))]

    def select(self, q, state: PrunedLayer, scores: jax.Array | None = None) -> jax.Array:
        """The composed selection: integer one-hot [R, k, C] over the finest clusters (rows in
        cluster order); R = H_kv, or 1 for a per-layer selection. q: [H, d]."""
        return P.chain_dense(self.select_chain(q, state, scores))

    def select_chain(self, q, state: PrunedLayer, scores: jax.Array | None = None) -> tuple:
        """Hierarchical selection as its levels' one-hots, coarse to fine (`primitives.chain_*`):
        ([R, k_0, C_0], [R, k_1, k_0 * r_1], ...), level i choosing among the r_i children of
        the clusters chosen above. Masks and one-hots are integers built from comparisons:
        under MPC none of them needs a truncation, and nothing composes them."""
        Hkv, S, _ = state.k.shape
        qg = q.reshape(Hkv, q.shape[0] // Hkv, q.shape[-1])
        level_scores = self.level_scores(qg, state, scores)
        R = 1 if self.scope_for(Hkv) == "layer" else Hkv   # rows that select
        sizes = self.sizes
        extent = state.extent()
        counts, bounds, valid = self.selection_counts(extent)
        total = [S // s for s in sizes]
        dtype = jnp.int32
        exact = extent.static   # static counts: the shortcuts below keep the program minimal

        def first_rows(k, n):   # public: the first k of n candidates
            return jnp.broadcast_to(jnp.eye(n, dtype=dtype)[:k], (R, k, n))

        # Level 0: every cluster of the kept region is a candidate.
        k0 = counts[0]
        if exact and k0 == valid[0]:
            chain = (first_rows(k0, total[0]),)
        else:
            forced = E.union(E.at(total[0], 0), E.at(total[0], valid[0] - 1))
            mask = P.topk_mask(level_scores[0](None), k0, valid=E.iota_lt(total[0], valid[0]),
                               forced=forced, method=self.topk_method, dtype=dtype,
                               k_max=bounds[0])
            chain = (P.mask_onehot(mask, bounds[0]),)                      # [R, k0, C0]

        # Finer levels: candidates are the children of the clusters chosen one level up (rows
        # past the chosen count are zero: their children are never valid candidates).
        for i in range(1, len(sizes)):
            r = sizes[i - 1] // sizes[i]
            n_cand = chain[-1].shape[1] * r
            pad = r * valid[i - 1] - valid[i]        # empty children sit at the very end
            real = counts[i - 1] * r - pad           # candidates holding tokens
            if exact and counts[i] == real:
                chain += (first_rows(counts[i], n_cand),)
                continue
            forced = E.union(E.at(n_cand, 0), E.at(n_cand, real - 1))
            mask = P.topk_mask(level_scores[i](chain), counts[i], valid=E.iota_lt(n_cand, real),
                               forced=forced, method=self.topk_method, dtype=dtype,
                               k_max=bounds[i])
            chain += (P.mask_onehot(mask, bounds[i]),)                     # [R, k_i, n_cand]
        return chain

    def selection_counts(self, extent: E.Extent):
        """Per level: clusters selected (count), their static bound, and clusters holding
        kept tokens, for a prompt of this extent."""
        levels = range(len(self.sizes))

        def level(i):
            return lambda t: self.level_counts(self.kept_count(t),
                                               P.budget_tokens(self.budget, t))[i]

        def holding(i):
            return lambda t: math.ceil(self.kept_count(t) / self.sizes[i])
        counts = [extent.count(level(i), (self, "level", i)) for i in levels]
        bounds = [extent.bound(level(i), (self, "level", i)) for i in levels]
        valid = [extent.count(holding(i), (self, "holding", i)) for i in levels]
        return counts, bounds, valid

    def selection(self, layer, q, state: PrunedLayer, carry, scores_all=None) -> tuple:
        """This layer's selection chain (`select_chain`): its own, or the previous selecting
        layer's (`carry`) under cross-layer sharing. scores_all: this step's
        attention scores [H_kv, G, S + N] ("exact" selection reads them)."""
        if self.selects(layer) or carry is None:
            scores = None if scores_all is None else scores_all[..., :state.k.shape[1]]
            return self.select_chain(q, state, scores)
        return carry

    def working_set(self, layer, q, state: PrunedLayer, carry) -> tuple[WorkingSet, tuple]:
        """(the working set this decode step attends to, carry). A refresh step (every
        `refresh_every`-th, counted by the public number of generated tokens) selects and
        gathers anew; the others keep the last one. The choice is a `lax.cond` on a public
        predicate: XLA and SPU both run only the branch taken."""
        valid = state.valid if self.static_per_head else state.valid[:1]

        def fresh(carry):
            scores = None
            if self.similarity == "exact":
                scores = attention.grouped_scores(q, state.k)                 # [H_kv, G, S]
            chain = self.selection(layer, q, state, carry, scores)
            return gather_working_set(chain, state.k, state.v, valid, self.sizes[-1]), chain

        chain_shape = jax.eval_shape(lambda c: fresh(c)[1], carry)

        def keep(carry):
            return state.working, jax.tree_util.tree_map(
                lambda x: jnp.zeros(x.shape, x.dtype), chain_shape)

        refresh = state.new.length % self.refresh_every == 0
        return jax.lax.cond(refresh, fresh, keep, carry)

    def attend(self, layer, q, k_new, v_new, state: PrunedLayer, carry):
        new = append_token(state.new, k_new, v_new)
        if not self.dynamic:
            out = attend_with_new(q, state.k, state.v, state.valid, new, self.softmax)
            return out, state.replace(new=new), carry
        if self.reuses:
            working, carry = self.working_set(layer, q, state, carry)
            out = attend_working_set(q, working, new, self.softmax)
            return out, state.replace(new=new, working=working), carry
        scores_all = None
        if self.similarity == "exact":   # one score matmul serves selection and attention
            scores_all = attention.grouped_scores(q, jnp.concatenate([state.k, new.k], axis=1))
        carry = self.selection(layer, q, state, carry, scores_all)
        valid = state.valid if self.static_per_head else state.valid[:1]
        out = attend_selected(q, state.k, state.v, valid, new, carry, self.sizes[-1],
                              normalize=self.softmax, scores_all=scores_all)
        return out, state.replace(new=new), carry

    def attended_slots(self, layer, q, state: PrunedLayer, carry) -> jax.Array:
        if not self.dynamic:
            return super().attended_slots(layer, q, state, carry)
        if self.reuses:
            working, _ = self.working_set(layer, q, state, carry)
            slots = working.attended_slots(*state.k.shape[:2])
            return slots * (state.valid > 0.5).astype(slots.dtype)
        chosen = P.chain_dense(self.selection(layer, q, state, carry))
        clusters = jnp.sum(chosen, axis=1)                                     # [H_kv, C]
        slots = jnp.repeat(clusters, self.sizes[-1], axis=-1)
        slots = jnp.broadcast_to(slots, state.valid.shape)
        return slots * (state.valid > 0.5).astype(slots.dtype)
