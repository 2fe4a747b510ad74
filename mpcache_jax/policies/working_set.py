"""MPCache's default: a working set of prompt clusters, selected every few decode steps and
gathered once, attended whole in between.

Per-step cost under MPC is designed to follow the budget, not the cache (docs/design.md, "The
default's cost"). A decode step attends to

  [ sink cluster | working set: S stripes x m clusters | recent window | generated tokens ]

- the prompt's first cluster (attention sinks) and its last tokens (the recent window) sit at
  public positions: they are read in place, never gathered;
- the working set holds the clusters a selection chose, gathered into a compact buffer with
  one-hot products. Selection happens on a public schedule (each of the first `dense_steps`
  decode steps, then every `refresh_every`-th): the steps between attend to the gathered
  buffer as it is;
- a selection scores every middle cluster, ranks them and gathers the chosen clusters' keys
  and values. The middle clusters are dealt round robin into S stripes (cluster j to stripe
  j mod S) and each stripe keeps its best m: the gather's one-hot products then cost m x T x
  row instead of k x T x row for a free choice of k = S m clusters (the multiply-accumulates
  of an oblivious gather grow with its candidates per output row), and the ranking runs on S
  rows of T / (S c) candidates at constant depth;
- the softmax of a step runs over the sink, the working set, the recent window and the
  generated tokens only, with its row max over a power-of-two count
  (`attention.reduce_max`).

Counts follow the prompt length t: the budget B(t) tokens (a ratio of t or a count) holds the
sink cluster, S x c x m(t) selected tokens and the recent window (whatever the selection's
whole clusters leave, at least `recent_min` tokens while selection runs: where its start at a
cluster boundary needs more, the sink cluster gives them up). The cluster size c
and the stripes S come from the length class at or above t (2^k or 3 x 2^(k-1): `geometry`),
so every prompt of a bucket between two such lengths shares one layout and one compiled
program; t itself may be a runtime value (bucketed prompts) through `mpcache_jax.extent`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax import extent as E
from mpcache_jax import primitives as P
from mpcache_jax.cache import (LayerKV, append_token, nested_field, public_field,
                               secret_field)
from mpcache_jax.policies.base import PromptEvictionPolicy, new_region, prompt_kv

CLUSTER_SCORES = ("auto", "max", "mean", "mass")
TOKEN_WISE = ("max", "mass")    # cluster scores read every token's q . k
# cluster_score="mass": a token's weight is exp(MASS_SCALE x (its score less the sink
# slot's)). SmolLM2's scores reach 28.6 above the sink's (two 8192-token prompts, every
# layer and head): exp(28.6) x the 192 scores of a cluster of 64 (3 query heads) would pass
# the 2^44 that FM64 with 18 fraction bits holds. At half the exponent the sum stays inside
# for exponents up to 47 (clusters of 256, 4 query heads), with no comparison: a cap (a
# minimum over every score) cost 29 MB per step on two SmolLM2 layers at 8192 tokens.
MASS_SCALE = 0.5
# cluster_score="auto": the mass on models whose keys are RMS-normalised per head (QK-norm:
# Gemma 3) for prompts up to AUTO_MASS_MAX_LENGTH tokens' class, the maxima otherwise. Under
# QK-norm every key has one norm, so one token's score stands out little from its cluster's
# and a cluster's summed weight carries more of the query's evidence; SmolLM2's best tokens
# stand far above the rest (up to 28.6 above the sink's score) and its answers follow them.
# On Gemma the mass answered more at 2048 tokens (pooled 0.309 against 0.253, n = 30 per set)
# and about as many at 8192 (0.215 against 0.228), with fewer messages at both; on SmolLM2
# fewer at 2048 (docs/results.md, "Fidelity of the default"). Past 8192 the clusters stop
# growing and their count grows instead (MAX_CLUSTER): at 16384 tokens on Gemma the mass
# missed more of the needles than the maxima and kept further from `full` (docs/results.md,
# "At the shipped budget"), so the maxima take over from the next class (12288) up.
AUTO_NORMALIZED_CLUSTER_SCORE = "mass"
AUTO_MASS_MAX_LENGTH = 8192
TOKEN_SCORES = ("auto", "dot", "cosine", "key_cosine")
# token_score="auto" on models whose keys are RMS-normalised per head (QK-norm): a key's norm
# there comes from the k-norm's learned scale, not the token, and misleads a dot product.
# Dividing by the keys' norms alone answered as the full cosine on Gemma 3 (the same task
# scores at 2048 and 8192 tokens, KL within 3%) and spares each refresh the inverse square
# root of the query heads' norms (under ABY3 56 of the 123 messages a refresh added per
# global layer of Gemma at 8192 tokens).
AUTO_NORMALIZED_SCORE = "key_cosine"
SELECT_SCOPES = ("auto", "layer", "head")
# select_scope="auto": one selection per KV head on models with at most this many KV heads
# (SmolLM2's 3, Gemma 3's 1), else one per layer shared by its heads (a per-head selection
# multiplies the ranking and the gather's rounds by the KV heads).
AUTO_HEAD_MAX_KV_HEADS = 4
# cluster_size=0: the cluster size is the power of two at or below the geometry length over
# `candidates`, within [MIN_CLUSTER, MAX_CLUSTER]. Clusters of 4 below 1024 tokens: a short
# prompt's budget holds few clusters, and one 8-token cluster is too coarse a working set
# (the main job's 173-token prompt at 48 tokens lost its answer with 8, keeps it with 4).
# Clusters of at most 64 from 8192 tokens up (the candidates grow as T / 64, and with them
# the stripes): at 16384 tokens Gemma answered less with clusters of 128 (0.79x `full`'s
# pooled score on 20 samples per set, KL 0.090) than with 64 (0.86x, KL 0.056).
# From the LONG_CLASS class up (prompts above 16384 tokens) at most LONG_MAX_CLUSTER: at
# 32768 tokens on Gemma clusters of 64 lost multi_needle answers `full` had, clusters of 32
# kept them (as many stripes again, each ranking as many candidates), and a refresh sent
# fewer bytes with the same messages under ABY3 (docs/results.md, "At the shipped budget").
MIN_CLUSTER, MAX_CLUSTER = 4, 64
LONG_CLASS, LONG_MAX_CLUSTER = 24576, 32
# Fewest sink tokens a prompt attends when its recent window takes the rest of the sink
# cluster (`plan`): StreamingLLM's four initial tokens.
SINK_MIN_TOKENS = 4
# Widest last tournament stage a stripe's top-1 takes over (`fused_runs`): its ranking grows
# with (r n_b)^2, the stage it saves is two comparison rounds.
FUSED_MAX_RUNS = 8
# The working-set gather is one product per stripe (and KV head), a round of messages each
# under MPC, or block-diagonal products of g of them at once: g products' rounds become one,
# and their local work grows g-fold (g x one gather's m_max x n_b x row multiply-accumulates
# per round saved). Groups are as large as keep that work per saved round at most this:
# SmolLM2 at 4096 tokens (21 gathers of 78k: one product), Gemma at 8192 (8 of 524k: one),
# Gemma at 16384 (17 of 492k: 3 products). Where the whole spread is too much work, groups
# are formed only of gathers of at most GATHER_GROUP_MAX_MACS each: llama2-d1024's per-layer
# rows (7 gathers of 1.2M at 4096, 8 of 2.1M at 8192) keep one product per stripe: in groups
# of 2 at 8192 a refresh step took 4.69 s on a LAN with compute against the loop's 4.61 s and
# saved 8 of its 1,361 messages (docs/results.md, "Cost per decode step").
GATHER_SPREAD_MAX_LOOP_MACS = 1 << 22
GATHER_GROUP_MAX_MACS = 1 << 20
# tournament_fanin=0: the cluster-max tournament's fan-in. A layer that selects once (a
# selection shared by its heads, or one KV head) takes wide stages: few rounds, and its
# comparisons are shared by the query heads. Selecting per KV head pays the comparisons per
# head: at fan-in 16 (7.5 per token) a refresh of SmolLM2's 3 KV heads cost more bytes than
# `full`'s whole step at 4096 tokens; at 4 (1.9 per token over two stages) 0.77x.
AUTO_FANIN_ONE_ROW, AUTO_FANIN_ROWS = 16, 4


def geometry_length(t: int) -> int:
    """The smallest of 2^k and 3 x 2^(k-1) at or above t (..., 1024, 1536, 2048, 3072, 4096,
    6144, 8192, ...): prompts that share it share a layout."""
    power = 1 << max(0, (int(t) - 1).bit_length())
    three_quarters = power // 4 * 3
    return three_quarters if three_quarters >= t else power


def shorter_length(length: int) -> int:
    """The geometry length below `length` (the longest prompt of the class before it)."""
    return length * 2 // 3 if length & (length - 1) else length * 3 // 4


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static layout of one prompt shape (a static length, or a bucket of lengths that
    share `geometry_length`).

    cluster: tokens per cluster (c); stripes: S; clusters: clusters tiling the prompt region
    (cluster 0 is the sink); per_stripe: candidate slots of a stripe (n_b, the middle clusters
    1 .. padded to S x n_b); picks: clusters a stripe keeps at most (m_max); recent: slots of
    the recent window (its longest over the shape's lengths)."""

    cluster: int
    stripes: int
    clusters: int
    per_stripe: int
    picks: int
    recent: int

    @property
    def region(self) -> int:
        return self.clusters * self.cluster

    @property
    def working(self) -> int:
        """Slots of the working set: S x m_max clusters."""
        return self.stripes * self.picks * self.cluster


@flax.struct.dataclass
class WorkingSetLayer:
    """One layer's decode state.

    k, v: [H_kv, C c, d] the prompt region (the dense prefill cache, padded to whole
    clusters); token_major (cluster scores "max" and "mass"): k is [C c, H_kv, d]: a step scores
    every token with one product [C c, H_kv d] x [H_kv d] (a selection shared by the heads:
    under ABY3 ~14x less compute than the same sum as a product per head at 4096 tokens) or
    x [H_kv d, H_kv G] (the queries block-diagonal: one round instead of one per KV head);
    read through `prompt_keys`; striped: the middle clusters' keys and values as a selection
    gathers them, laid out once here ([S, n_b, H_kv c 2d] for a selection shared by the
    heads, [H_kv, S, n_b, c 2d] per head: `stripe_rows`) so that no selection moves the
    whole region into its layout again (a secret copy of every slot: 3.3 s of a 3.8 s
    selection per layer at 8192 tokens on llama2-d1024 under ABY3); digest: [H_kv, C, d]
    cluster mean keys (cluster_score="mean") or None; inv_norms: [H_kv, C c] 1/|k|
    (token scores divided by the keys' norms) or None; working_k, working_v:
    [H_kv, W, d] the gathered clusters (W = Geometry.working); picked: int32 [R, S m_max]
    the middle cluster behind each working-set cluster (analysis only); new: LayerKV of the
    generated tokens; prompt_len: static prompt slots; length: int32 [] real prompt tokens of
    a bucketed prompt (None: static); low: the bucket's smallest length; score: the cluster
    score this model's prompt resolved to ("max", "mean" or "mass")."""

    k: jax.Array = secret_field()
    v: jax.Array = secret_field()
    striped: jax.Array = secret_field()
    digest: Any = secret_field()
    inv_norms: Any = secret_field()
    working_k: jax.Array = secret_field()
    working_v: jax.Array = secret_field()
    picked: jax.Array = secret_field()
    new: LayerKV = nested_field()
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    length: jax.Array | None = public_field(default=None)
    low: int = flax.struct.field(pytree_node=False, default=1)
    score: str = flax.struct.field(pytree_node=False, default="max")

    def extent(self) -> E.Extent:
        if self.length is None:
            return E.Extent(self.prompt_len, self.prompt_len)
        return E.Extent(self.prompt_len, self.length, self.low)

    @property
    def token_major(self) -> bool:
        """Whether k is stored [C c, H_kv, d] (cluster scores that read every token)."""
        return self.score in TOKEN_WISE

    @property
    def kv_heads(self) -> tuple[int, int]:
        """(H_kv, d)."""
        return self.v.shape[0], self.v.shape[-1]

    def prompt_keys(self, begin, size: int) -> jax.Array:
        """Keys of prompt slots [begin, begin + size): [H_kv, size, d]; begin an int or an
        int32 scalar (public)."""
        axis = 0 if self.token_major else 1
        if isinstance(begin, (int, np.integer)):
            part = jax.lax.slice_in_dim(self.k, begin, begin + size, axis=axis)
        else:
            part = jax.lax.dynamic_slice_in_dim(self.k, begin, size, axis=axis)
        return part.transpose(1, 0, 2) if self.token_major else part


@dataclasses.dataclass(frozen=True)
class WorkingSetMPCache(PromptEvictionPolicy):
    """MPCache's default (registered as `mpcache`; module docstring).

    budget: prompt tokens attended per decode step (a ratio of the prompt, a count, or a
      ratio with a floor in tokens, `primitives.Budget`). The stripes follow the ratio: a
      floor above it gives each stripe more clusters (m), not more stripes (each stripe's
      gather is a round of messages under MPC), so lengths whose ratio reaches the floor keep
      the ratio's plan.
    refresh_every: decode steps between two selections (1 = every step); the schedule counts
      generated tokens, so it is public.
    stagger_layers: layers take turns: layer l selects at the steps where step + l is a
      multiple of `refresh_every` (False: every layer at the multiples). Each step then pays
      1 / refresh_every of the layers' selections instead of all of them every
      refresh_every-th step (the same mean cost, a flat per-step cost), and at every step
      some layers attend to a selection made for this step's own query.
    dense_steps: the first this many decode steps all select, then every `refresh_every`-th
      step (public, like the period). The first steps write a question's answer, and the
      tokens they write are attended by every later step: they get selections made for their
      own queries. 8 with refresh_every=3 selects at 16 of 32 steps, as refresh_every=2 does,
      13 of 24, 27 of 64.
    cluster_size: tokens per cluster; 0 = the geometry length / `candidates` within [4, 64]
      (the cluster grows with the prompt up to 64 tokens, then the candidates grow; 32 above
      16384 tokens).
    candidates: clusters a prompt of the geometry length is cut into (cluster_size=0).
    stripes: S, the rows the selection ranks (each keeps its best m clusters); 0 = as many
      as the budget of the smallest prompt of the geometry length holds clusters, so m >= 1
      for every prompt of a power-of-two bucket.
    recent_min: tokens the recent window keeps at least while selection runs.
    cluster_score: "auto" (AUTO_NORMALIZED_CLUSTER_SCORE on models whose keys are
      RMS-normalised per head (QK-norm: Gemma 3) for prompts up to the AUTO_MASS_MAX_LENGTH
      class, "max" otherwise), "max" (a cluster scores its best token: the step's q . k over
      every middle token, then a max over each cluster), "mass" (the attention mass the cluster
      would get, softened: the sum over its tokens and the group's query heads of exp of
      MASS_SCALE x (q . k / sqrt(d) less the sink slot's score); no comparison before the
      ranking: under MPC an exponential and a sum in place of the maxima's tournament) or
      "mean" (its mean key's q . k: one product with C digests computed once at prefill).
    token_score: "dot" (q . k), "cosine" (q . k / (|q| |k|)), "key_cosine" (q . k / |k|: the
      keys' norms only, computed once at prefill; no query norm per step) or "auto"
      (with "max": AUTO_NORMALIZED_SCORE on models whose keys are RMS-normalised per head
      (QK-norm: Gemma 3), dot otherwise; with "mass": dot, the attention's own logits);
      "max" and "mass" only.
    group_reduce: how a GQA group's query heads combine a token's score with
      cluster_score="max": "max" (best head) or "sum"; a per-layer selection then sums over
      KV heads. ("mass" sums the heads' weights.)
    select_scope: "layer" (one selection shared by the layer's heads), "head" (one per KV
      head) or "auto" (per head on models with at most 4 KV heads).
    share_layers: layers that share one selection (the paper's cross-layer index sharing):
      evicting layer l selects when l is a multiple of share_layers, and the next
      share_layers - 1 layers gather their own keys and values at the clusters it picked
      (per KV head: head h takes head h's picks). 1 = every layer selects. Above 1 the
      selection crosses layers in the decode step's carry, so the layers run one after
      another, not as a loop.
    tournament_fanin: under MPC, entries the cluster-max tournament ranks at once (a power
      of two: (f - 1) / 2 comparisons per token and two comparison rounds per stage); 0 =
      AUTO_FANIN_ONE_ROW where a layer selects once (shared by its heads, or one KV head),
      AUTO_FANIN_ROWS per KV head of several (each head pays the comparisons). The picks are
      the same at every fan-in.
    """

    REQUIRED_HOOKS = ()
    HOOKS = ()
    PER_LAYER_BUDGET = False
    # The stripes are small rows ranked at constant depth: always the pairwise rank.
    TOPK_METHODS = ("rank",)

    name: str = "mpcache"
    topk_method: str = "rank"
    refresh_every: int = 3
    stagger_layers: bool = False
    dense_steps: int = 8
    share_layers: int = 1
    cluster_size: int = 0
    candidates: int = 128
    stripes: int = 0
    recent_min: int = 32
    cluster_score: str = "auto"
    token_score: str = "auto"
    group_reduce: str = "max"
    select_scope: str = "auto"
    tournament_fanin: int = 0

    def __post_init__(self):
        super().__post_init__()
        for name, low in (("refresh_every", 1), ("share_layers", 1), ("candidates", 2),
                          ("recent_min", 0), ("cluster_size", 0), ("stripes", 0),
                          ("dense_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if not isinstance(self.stagger_layers, bool):
            raise ValueError(f"stagger_layers={self.stagger_layers!r} must be True or False")
        if self.stagger_layers and self.share_layers > 1:
            raise ValueError("stagger_layers=True gives each layer its own refresh steps; a "
                             f"selection shared by layers (share_layers={self.share_layers}) "
                             "needs one schedule: set one of them to its default")
        fanin = self.tournament_fanin
        if isinstance(fanin, bool) or not isinstance(fanin, int) or (
                fanin and (fanin < 2 or fanin & (fanin - 1))):
            raise ValueError(f"tournament_fanin={fanin!r} must be a power of two >= 2 (or 0 "
                             "for the fan-in that follows the selection's scope)")
        if self.cluster_size and (self.cluster_size < 2 or self.cluster_size & (self.cluster_size - 1)):
            raise ValueError(f"cluster_size={self.cluster_size} must be a power of two >= 2 (or 0 "
                             "for the size that follows the prompt length)")
        if self.cluster_score not in CLUSTER_SCORES:
            raise ValueError(f"cluster_score={self.cluster_score!r}; use one of {CLUSTER_SCORES}")
        if self.token_score not in TOKEN_SCORES:
            raise ValueError(f"token_score={self.token_score!r}; use one of {TOKEN_SCORES}")
        if (self.token_score in ("cosine", "key_cosine")
                and self.cluster_score not in TOKEN_WISE + ("auto",)):
            raise ValueError(f"token_score={self.token_score!r} scores single tokens: it needs "
                             "cluster_score='max' or 'mass'")
        if self.group_reduce not in ("max", "sum"):
            raise ValueError(f"group_reduce={self.group_reduce!r}; use 'max' or 'sum'")
        if self.select_scope not in SELECT_SCOPES:
            raise ValueError(f"select_scope={self.select_scope!r}; use one of {SELECT_SCOPES}")
        if self.topk_method not in self.TOPK_METHODS:
            raise ValueError("this policy ranks its stripes with the pairwise rank "
                             f"(topk_method='rank'), not {self.topk_method!r}")

    # --- counts ------------------------------------------------------------------------------
    def budget_at(self, t: int) -> int:
        """B(t): prompt tokens a step attends for a t-token prompt (the budget's ratio of t, its
        count, at least its floor; at most t)."""
        return P.budget_tokens(self.budget, t)

    def cluster_of(self, length: int) -> int:
        """c for prompts of this geometry length: the power of two at or below length /
        candidates, within [MIN_CLUSTER, MAX_CLUSTER] (LONG_MAX_CLUSTER from the LONG_CLASS
        class up)."""
        if self.cluster_size:
            return self.cluster_size
        size = 1 << max(0, (length // self.candidates).bit_length() - 1)
        largest = LONG_MAX_CLUSTER if length >= LONG_CLASS else MAX_CLUSTER
        return int(min(largest, max(MIN_CLUSTER, size)))

    def stripes_of(self, length: int) -> int:
        """S for prompts of this geometry length: as many clusters as the budget of the
        class's shortest prompt holds beside its sink and recent window, so that every prompt
        of the class keeps m >= 1 cluster per stripe, and m = 1 for most (a gather of m x T x
        row multiply-accumulates: the fewer per stripe, the cheaper)."""
        if self.stripes:
            return self.stripes
        c = self.cluster_of(length)
        smallest = shorter_length(length) + 1 if length > 2 else 1
        room = (P.budget_tokens(P.budget_ratio(self.budget), smallest) - min(c, smallest)
                - self.recent_min)
        return max(1, room // c)

    def plan(self, t: int) -> tuple[int, int]:
        """(m, recent start) for a prompt of t tokens: clusters each stripe keeps, and the
        first slot of the recent window ([start, t) is attended as it is; a cluster boundary
        when m > 0). m = 0: no selection (the budget holds the whole prompt, or too little
        room is left for whole clusters)."""
        L = geometry_length(t)
        c, S = self.cluster_of(L), self.stripes_of(L)
        B = self.budget_at(t)
        sink = min(c, t)
        if B >= t:
            return 0, sink
        if B < sink:
            raise ValueError(f"policy {self.name!r}: a budget of {B} tokens (prompt {t}) "
                             f"cannot hold the sink cluster of {sink} tokens; raise the budget "
                             "or set a smaller cluster_size")
        m = max(0, (B - sink - self.recent_min) // (S * c))
        while m > 0:
            # The recent window starts at a cluster boundary and holds the last, partial
            # cluster: the middle clusters before it are whole, and every stripe must hold m
            # of them.
            start = math.ceil((t - (B - sink - S * c * m)) / c) * c
            starts = [start]
            earlier = (t - self.recent_min) // c * c
            if start > earlier and B - S * c * m - (t - earlier) >= min(SINK_MIN_TOKENS, sink):
                # Rounding up to a boundary left the window fewer than recent_min tokens (a
                # prompt just past a boundary: none at all): it starts earlier, and the sink
                # cluster gives up the tokens the budget then lacks, where it has them.
                starts.insert(0, earlier)
            for start in starts:
                if start <= t // c * c and (start // c - 1) // S >= m:
                    return m, start
            m -= 1
        return 0, max(sink, t - (B - sink))    # no selection: the budget's last tokens

    def sink_of(self, t: int) -> int:
        """The sink cluster's tokens a t-token prompt attends: the whole cluster, less what the
        recent window needed beyond the budget (`plan`)."""
        L = geometry_length(t)
        c, S = self.cluster_of(L), self.stripes_of(L)
        m, start = self.plan(t)
        sink = min(c, t)
        return sink if m == 0 else min(sink, self.budget_at(t) - S * c * m - (t - start))

    def geometry(self, extent: E.Extent) -> Geometry:
        """The static layout of this extent's prompt shape (`check_bucketed` makes sure that
        a bucket's lengths share one)."""
        L = self.length_class(extent)
        c, S = self.cluster_of(L), self.stripes_of(L)
        clusters = math.ceil(extent.capacity / c)
        per_stripe = max(1, math.ceil((clusters - 1) / S))
        lengths = [extent.length] if extent.static else range(extent.low, extent.capacity + 1)
        plans = [self.plan(t) for t in lengths]
        return Geometry(cluster=c, stripes=S, clusters=clusters, per_stripe=per_stripe,
                        picks=max(1, max(m for m, _ in plans)),
                        recent=max(max(t - start for t, (_, start) in zip(lengths, plans)), 1))

    @staticmethod
    def length_class(extent: E.Extent) -> int:
        """The geometry length of this extent's prompts (its shortest, for a bucket: a bucket
        lies in one class, `check_bucketed`)."""
        return geometry_length(extent.length if extent.static else extent.low)

    def counts(self, extent: E.Extent):
        """(m, recent start, sink tokens) of this extent: ints, or int32 scalars for a runtime
        length."""
        return (extent.count(lambda t: self.plan(t)[0], (self, "picks")),
                extent.count(lambda t: self.plan(t)[1], (self, "recent_start")),
                extent.count(self.sink_of, (self, "sink")))

    def kept_count(self, prompt_len: int) -> int:
        """Nothing is evicted at prefill: the whole prompt stays in the region."""
        return prompt_len

    def check_prompt(self, prompt_len: int) -> None:
        """Raise ValueError where the budget cannot hold the sink cluster, or where hand-set
        `stripes` leave no room for a cluster per stripe although as many stripes as the
        budget holds (stripes=0) would select: nothing would be selected, only the sink and
        the budget's last tokens attended."""
        m, _ = self.plan(prompt_len)   # a budget that holds the prompt: m = 0 for any stripes
        if m or not self.stripes:
            return
        fitted = dataclasses.replace(self, stripes=0)
        if fitted.plan(prompt_len)[0]:
            budget = self.budget_at(prompt_len)
            length = geometry_length(prompt_len)
            c = self.cluster_of(length)
            raise ValueError(
                f"policy {self.name!r}: stripes={self.stripes} need {self.stripes * c} tokens "
                f"for one {c}-token cluster each, beside the sink cluster and a recent window "
                f"of {self.recent_min}; a budget of {budget} tokens for a {prompt_len}-token "
                "prompt holds fewer, so nothing would be selected; set fewer stripes "
                f"(stripes=0: as many as the budget holds, {fitted.stripes_of(length)} here) "
                "or a larger budget")

    def check_bucketed(self, length: int, low: int, capacity: int) -> None:
        if geometry_length(low) != geometry_length(capacity):
            raise ValueError(f"policy {self.name!r} lays out prompts by the length class "
                             f"(2^k or 3 x 2^(k-1)) at or above their length: the bucket "
                             f"[{low}, {capacity}] spans {geometry_length(low)} and "
                             f"{geometry_length(capacity)}; use bucket edges at such lengths "
                             "(e.g. 1024, 1536, 2048, 3072, 4096, 6144, 8192)")

    def ranked_rows(self, prompt_len: int, num_kv_heads: int) -> tuple[int, int]:
        """(rows, candidates per row) a selection ranks: S stripes per selecting row."""
        geo = self.geometry(E.Extent(prompt_len, prompt_len))
        rows = 1 if self.scope_for(num_kv_heads) == "layer" else num_kv_heads
        return rows * geo.stripes, geo.per_stripe

    def scope_for(self, num_kv_heads: int) -> str:
        if self.select_scope != "auto":
            return self.select_scope
        return "head" if num_kv_heads <= AUTO_HEAD_MAX_KV_HEADS else "layer"

    def fanin_for(self, num_kv_heads: int) -> int:
        """The cluster-max tournament's fan-in (`tournament_fanin`)."""
        if self.tournament_fanin:
            return self.tournament_fanin
        rows = 1 if self.scope_for(num_kv_heads) == "layer" else num_kv_heads
        return AUTO_FANIN_ONE_ROW if rows == 1 else AUTO_FANIN_ROWS

    # --- the decode cache --------------------------------------------------------------------
    def compress(self, cache, aux, max_new_tokens: int):
        extent = E.of(aux)
        if extent.static:
            self.check_prompt(extent.length)
        else:
            self.check_bucketed(extent.low, extent.low, extent.capacity)
        geo = self.geometry(extent)
        T = extent.capacity
        cosine = self.uses_cosine(aux)
        score = self.resolved_cluster_score(aux)
        valid = E.iota_lt(geo.region, extent.length)                       # [C c] public
        out = []
        for layer in cache:
            k, v = (jnp.pad(x, ((0, 0), (0, geo.region - T), (0, 0)))
                    for x in prompt_kv(layer, T))
            Hkv, _, d = k.shape
            rows = 1 if self.scope_for(Hkv) == "layer" else Hkv
            digest = None
            if score == "mean":
                w = jnp.asarray(valid, k.dtype).reshape(1, geo.clusters, geo.cluster, 1)
                total = jnp.sum(k.reshape(Hkv, geo.clusters, geo.cluster, d) * w, axis=2)
                digest = total / jnp.maximum(jnp.sum(w, axis=2), 1.0)
            zeros = jnp.zeros((Hkv, geo.working, d), k.dtype)
            out.append(WorkingSetLayer(
                k.transpose(1, 0, 2) if score in TOKEN_WISE else k, v,
                self.stripe_rows(k, v, geo, rows), digest,
                P.inverse_norms(k) if cosine else None, zeros, zeros,
                jnp.zeros((rows, geo.stripes * geo.picks), jnp.int32),
                new_region(layer, max_new_tokens), prompt_len=T,
                length=None if extent.static else extent.length, low=extent.low,
                score=score))
        return tuple(out)

    def uses_cosine(self, aux) -> bool:
        """Whether token scores divide by the keys' norms (`token_score` cosine, key_cosine)."""
        return (self.resolved_cluster_score(aux) in TOKEN_WISE
                and self.resolved_score(aux) != "dot")

    def resolved_cluster_score(self, aux) -> str:
        """The cluster score this prompt's model and length class get ("max", "mean" or
        "mass")."""
        if self.cluster_score != "auto":
            return self.cluster_score
        if aux.normalized_keys and self.length_class(E.of(aux)) <= AUTO_MASS_MAX_LENGTH:
            return AUTO_NORMALIZED_CLUSTER_SCORE
        return "max"

    def resolved_score(self, aux) -> str:
        """The token score this prompt's model gets ("dot", "cosine" or "key_cosine")."""
        if self.token_score != "auto":
            return self.token_score
        if self.resolved_cluster_score(aux) == "mass":
            return "dot"
        return AUTO_NORMALIZED_SCORE if aux.normalized_keys else "dot"

    def unit_queries(self) -> bool:
        """Whether a step divides the queries by their norms (token_score="cosine"; "auto"
        never does)."""
        return self.token_score == "cosine"

    def free_slots(self, cache) -> int:
        new = cache[0].new
        return int(new.capacity - new.length)

    # --- selection -----------------------------------------------------------------------------
    def cluster_scores(self, q: jax.Array, state: WorkingSetLayer, geo: Geometry,
                       per_cluster: int = 1) -> jax.Array:
        """[R, C] every cluster's score for this step's query q [H, d]; with per_cluster = r >
        1 (`cluster_score="max"` only) the maxima of each cluster's r runs of c / r tokens:
        [R, C, r]."""
        Hkv, d = state.kv_heads
        G = q.shape[0] // Hkv
        qg = attention.grouped_queries(q, Hkv)
        per_layer = self.scope_for(Hkv) == "layer"
        if state.score == "mean":
            # linear in q: the group's queries are summed first, one product with the digests
            if per_layer:
                return jnp.einsum("hd,hcd->c", jnp.sum(qg, axis=1), state.digest)[None]
            return jnp.einsum("hd,hcd->hc", jnp.sum(qg, axis=1), state.digest)
        cosine = state.inv_norms is not None
        if cosine and self.unit_queries():
            qg = P.unit_rows(qg)
        flat = state.k.reshape(state.k.shape[0], Hkv * d)       # token-major k: [T, H_kv d]
        if state.score == "mass":
            token = self.head_scores(flat, qg)                               # [H_kv, G, T]
            if cosine:
                token = token * state.inv_norms[:, None]
            # relative to the sink slot's score (a public position: no comparison), scaled
            # so that a cluster's sum stays inside fixed point under MPC (MASS_SCALE)
            weight = jnp.exp((token - token[..., :1]) * MASS_SCALE)
            weight = jnp.sum(weight, axis=1)                                 # [H_kv, T]
            if per_layer:
                weight = jnp.sum(weight, axis=0, keepdims=True)
            return jnp.sum(weight.reshape(weight.shape[0], geo.clusters, geo.cluster), -1)
        if per_layer and not cosine and (self.group_reduce == "sum" or G == 1):
            token = (flat @ jnp.sum(qg, axis=1).reshape(Hkv * d))[None]               # [1, T]
        else:
            token = self.head_scores(flat, qg)                               # [H_kv, G, T]
            token = (jnp.sum(token, axis=1) if self.group_reduce == "sum"
                     else jnp.max(token, axis=1))                            # [H_kv, T]
        if cosine:
            token = token * state.inv_norms
        if per_layer and token.shape[0] > 1:
            token = jnp.sum(token, axis=0, keepdims=True)
        return P.group_max(token, geo.cluster, per_cluster,                 # [R, C] / [R, C, r]
                           fanin=self.fanin_for(Hkv))

    @staticmethod
    def head_scores(flat: jax.Array, qg: jax.Array) -> jax.Array:
        """Every query head's q . k against every token: flat [T, H_kv d] token-major keys, qg
        [H_kv, G, d] -> [H_kv, G, T], in one product with the queries block-diagonal
        [H_kv d, H_kv G] (a product per KV head is a round each under MPC)."""
        Hkv, G, _ = qg.shape
        token = flat @ P.block_diagonal(qg.transpose(0, 2, 1))               # [T, H_kv G]
        return token.reshape(-1, Hkv, G).transpose(1, 2, 0)

    def fused_runs(self, geo: Geometry, num_kv_heads: int, score: str = "max") -> int:
        """Under MPC with one pick per stripe: the fan-in r of the cluster-max tournament's last
        stage when the top-1 of each stripe can take that stage's place (its r x n_b partial
        maxima ranked at once pick the same cluster, ties to the lower index as before: one
        stage = two comparison rounds fewer per refresh). 1: no fusion (plaintext, m_max > 1,
        mean scores, a one-stage tournament, or a last stage wider than FUSED_MAX_RUNS)."""
        if (geo.picks != 1 or score != "max" or not P.tracing_for_mpc()):
            return 1
        fanins = P.tournament_fanins(geo.cluster, self.fanin_for(num_kv_heads))
        if len(fanins) < 2 or fanins[-1] > FUSED_MAX_RUNS:
            return 1
        return fanins[-1]

    def select(self, q: jax.Array, state: WorkingSetLayer, geo: Geometry, m, start):
        """This step's choice: integer one-hot [R, S, m_max, n_b] over each stripe's candidate
        slots (rows past m zero), and the middle cluster of each picked row [R, S m_max]."""
        S, n = geo.stripes, geo.per_stripe
        r = self.fused_runs(geo, state.kv_heads[0], state.score)
        scores = self.cluster_scores(q, state, geo, r)[:, 1:]               # middle clusters
        scores = scores.reshape(scores.shape[0], -1, r)                       # [R, C_mid, r]
        R, C_mid, _ = scores.shape
        scores = jnp.pad(scores, ((0, 0), (0, S * n - C_mid), (0, 0)))
        index = np.arange(S * n).reshape(n, S).T                              # [S, n] public
        middle = start // geo.cluster - 1                    # middle clusters before the window
        valid = (index < middle if isinstance(middle, (int, np.integer))
                 else jnp.asarray(index) < middle)                  # bool: a select, public
        striped = scores.reshape(R, n, S, r).transpose(0, 2, 1, 3).reshape(R, S, n * r)
        repeat = np.repeat if isinstance(valid, np.ndarray) else jnp.repeat
        onehot = P.topk_onehot(striped, m, geo.picks,
                               valid=repeat(valid, r, axis=-1))               # [R, S, m, n r]
        if r > 1:   # the cluster of the picked run (one pick: a sum of r columns)
            onehot = jnp.sum(onehot.reshape(R, S, geo.picks, n, r), axis=-1)  # [R, S, m, n]
        picked = jnp.einsum("rsmn,sn->rsm", onehot, jnp.asarray(index, jnp.int32))
        return onehot, picked.reshape(R, S * geo.picks)

    @staticmethod
    def stripe_rows(k: jax.Array, v: jax.Array, geo: Geometry, rows: int) -> jax.Array:
        """The middle clusters (1 ..) of a prompt region k, v [H_kv, C c, d] as the gather's
        rows: middle cluster j in stripe j mod S at position j // S (padding past the last),
        keys and values side by side; a selection shared by the heads (rows = 1) moves every
        head's rows at once (heads folded into the row): [S, n_b, H_kv c 2d], per head
        [H_kv, S, n_b, c 2d]."""
        Hkv, _, d = k.shape
        S, n, c = geo.stripes, geo.per_stripe, geo.cluster
        kv = jnp.concatenate([k, v], axis=-1)                                 # [H_kv, C c, 2d]
        mid = kv.reshape(Hkv, geo.clusters, c * 2 * d)[:, 1:]
        mid = jnp.pad(mid, ((0, 0), (0, S * n - mid.shape[1]), (0, 0)))
        mid = mid.reshape(Hkv, n, S, c * 2 * d).transpose(0, 2, 1, 3)       # [H_kv, S, n, c 2d]
        if rows == 1:
            return mid.transpose(1, 2, 0, 3).reshape(S, n, Hkv * c * 2 * d)
        return mid

    def gather(self, onehot: jax.Array, state: WorkingSetLayer, geo: Geometry):
        """The picked clusters' keys and values -> ([H_kv, W, d], [H_kv, W, d]): one product
        [m_max, n_b] x [n_b, row] per stripe (per stripe and KV head for a per-head selection)
        over the rows laid out at compress (`stripe_rows`); under MPC block-diagonal products
        of `gather_group` of them each, a round of messages per product."""
        Hkv, d = state.kv_heads
        S, c, m = geo.stripes, geo.cluster, geo.picks
        group = self.gather_group(onehot.shape[0] * S, m * geo.per_stripe,
                                  state.striped.shape[-1])
        if onehot.shape[0] == 1:
            out = P.gather_rows(onehot[0], state.striped, group)            # [S, m, H_kv c 2d]
            out = out.reshape(S, m, Hkv, c, 2 * d).transpose(2, 0, 1, 3, 4)
        else:
            out = P.gather_rows(onehot, state.striped, group).reshape(Hkv, S, m, c, 2 * d)
        out = out.reshape(Hkv, S * m * c, 2 * d)
        return out[..., :d], out[..., d:]

    @staticmethod
    def gather_group(gathers: int, onehot_entries: int, row: int) -> int:
        """Stripe gathers per product under MPC (a round of messages each), for `gathers`
        one-hots of `onehot_entries` (m_max x n_b) over rows of `row` entries: g of them spread
        block-diagonally do g^2 gathers' work instead of g for g - 1 rounds fewer, g x one
        gather's work per round saved, taken while at most GATHER_SPREAD_MAX_LOOP_MACS (and
        the spread one-hot within P.BLOCK_DIAGONAL_MAX entries); groups short of all the
        gathers only of gathers of at most GATHER_GROUP_MAX_MACS."""
        work = max(1, onehot_entries * row)
        by_work = GATHER_SPREAD_MAX_LOOP_MACS // work
        if by_work < gathers and work > GATHER_GROUP_MAX_MACS:
            return 1                   # wide gathers: groups short of the whole spread lose
        by_size = math.isqrt(P.BLOCK_DIAGONAL_MAX // max(1, onehot_entries))
        return int(max(1, min(gathers, by_work, by_size)))

    def working_valid(self, geo: Geometry, m):
        """[W] 0/1: working-set slots of rows below m (public: m counts from the length)."""
        row = np.repeat(np.tile(np.arange(geo.picks), geo.stripes), geo.cluster)
        if isinstance(m, (int, np.integer)):
            return (row < m).astype(np.float32)
        return (jnp.asarray(row) < m).astype(jnp.float32)

    # --- decoding ------------------------------------------------------------------------------
    def refresh(self, layer, q, state: WorkingSetLayer, carry=None):
        """A new working set for this step (the public schedule decides when:
        `refresh_every`); a `lax.cond` on a public predicate runs one branch on XLA and SPU.
        Under `share_layers` a layer that does not select gathers at the picks in `carry`
        (one-hot [R, S, m_max, n_b] and picks [R, S m_max] of the layer that did).
        Returns (state, carry)."""
        extent = state.extent()
        geo = self.geometry(extent)
        m, start, _ = self.counts(extent)
        if isinstance(m, (int, np.integer)) and m == 0:
            return state, carry
        selects = self.share_layers == 1 or carry is None or layer % self.share_layers == 0
        shares = self.share_layers > 1

        def fresh():
            if selects:
                onehot, picked = self.select(q, state, geo, m, start)
            else:
                onehot, picked = carry
            return (*self.gather(onehot, state, geo), picked) + ((onehot,) if shares else ())
        if self.refresh_every == 1:   # (dense_steps changes nothing: every step selects)
            k, v, picked, *onehot = fresh()
        else:
            # (only the working set goes through the branch: under vmap a batched predicate
            # turns it into a select of its outputs)
            step = state.new.length
            if self.stagger_layers:
                # (every layer selects at the first step: no working set exists before it)
                due = ((step + layer) % self.refresh_every == 0) | (step == 0)
            else:
                due = step % self.refresh_every == 0
            if self.dense_steps:
                due = due | (step < self.dense_steps)
            kept = (state.working_k, state.working_v, state.picked)
            if shares:   # a reuse step hands the next layers zeros: they keep their own sets
                onehot_shape = jax.eval_shape(fresh)[3]
                kept += (jnp.zeros(onehot_shape.shape, onehot_shape.dtype),)
            k, v, picked, *onehot = jax.lax.cond(due, fresh, lambda: kept)
        if shares:
            carry = (onehot[0], picked)
        return state.replace(working_k=k, working_v=v, picked=picked), carry

    def attend(self, layer, q, k_new, v_new, state: WorkingSetLayer, carry):
        state, carry = self.refresh(layer, q, state, carry)
        new = append_token(state.new, k_new, v_new)
        extent = state.extent()
        geo = self.geometry(extent)
        m, start, sink = self.counts(extent)
        c, r = geo.cluster, geo.recent
        if isinstance(start, (int, np.integer)):
            begin = min(start, geo.region - r)
            recent_k, recent_v = state.prompt_keys(begin, r), state.v[:, begin:begin + r]
            slots = np.arange(begin, begin + r)
            recent_valid = ((slots >= start) & (slots < extent.length)).astype(np.float32)
            sink_valid = (np.arange(c) < sink).astype(np.float32)
        else:
            begin = jnp.minimum(start, geo.region - r)
            recent_k = state.prompt_keys(begin, r)
            recent_v = jax.lax.dynamic_slice_in_dim(state.v, begin, r, axis=1)
            slots = begin + jnp.arange(r)
            recent_valid = ((slots >= start) & (slots < extent.length)).astype(jnp.float32)
            sink_valid = (jnp.arange(c) < sink).astype(jnp.float32)
        parts_k = [state.prompt_keys(0, c), state.working_k, recent_k, new.k]
        parts_v = [state.v[:, :c], state.working_v, recent_v, new.v]
        parts_valid = [sink_valid, self.working_valid(geo, m), recent_valid, new.valid()]
        if all(isinstance(x, np.ndarray) for x in parts_valid[:3]):
            valid = jnp.concatenate([jnp.asarray(np.concatenate(parts_valid[:3])),
                                     parts_valid[3]])
        else:
            valid = jnp.concatenate([jnp.asarray(x, jnp.float32) for x in parts_valid])
        out = attention.decode_attention(q, jnp.concatenate(parts_k, axis=1),
                                         jnp.concatenate(parts_v, axis=1), valid, self.softmax)
        return out, state.replace(new=new), carry

    # --- analysis --------------------------------------------------------------------------------
    def prompt_keep(self, cache, aux):
        """Nothing is evicted at prefill: every real prompt token stays (mechanism probes)."""
        extent = E.of(aux)
        return [(jnp.asarray(extent.valid()),) + self.layer_count(extent, len(cache), index)
                for index in range(len(cache))]

    def attended_shape(self, state: WorkingSetLayer) -> tuple[int, int]:
        """[H_kv, C c]: `attended_slots` covers the whole prompt region (nothing is evicted)."""
        return (state.kv_heads[0], state.v.shape[1])

    def attended_slots(self, layer, q, state: WorkingSetLayer, carry) -> jax.Array:
        """0/1 [H_kv, C c]: the prompt-region slots this step attends to (analysis)."""
        state, _ = self.refresh(layer, q, state, carry)
        extent = state.extent()
        geo = self.geometry(extent)
        m, start, sink = self.counts(extent)
        Hkv = state.kv_heads[0]
        slots = jnp.arange(geo.region)
        cluster = slots // geo.cluster
        attended = (slots < sink) | ((slots >= start) & (slots < extent.length))
        rows = jnp.repeat(jnp.arange(geo.picks)[None], geo.stripes, 0).reshape(-1)
        live = rows < m                                                     # [S m_max]
        chosen = state.picked + 1                                           # prompt clusters
        hit = (cluster[None, None, :] == chosen[..., None]) & live[None, :, None]
        per_row = attended[None] | jnp.any(hit, axis=1)                     # [R, C c]
        return jnp.broadcast_to(per_row, (Hkv, geo.region)).astype(jnp.int32)
