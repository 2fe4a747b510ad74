"""Backends that run one jittable function under a visibility spec: plaintext XLA or SPU.

Every backend (also one party of a multi-process run, `runtime.distributed.NodeBackend`)
exposes the same calls, so the programs and the session loop are shared:

    backend = make_backend("spu_sim", MPCConfig(protocol="ABY3"))     # or "xla"
    program = backend.compile(fn, example_args, visibility)   # visibility: pytree of SECRET/PUBLIC
    shared = backend.share(args, visibility, owner=CLIENT)     # secret-share inputs (per leaf)
    outputs, cost, wall = backend.run(program, shared_args...) # outputs stay shared
    values = backend.reveal(outputs, to=CLIENT)                # reconstruct (for the owner)
    flag = backend.agree(value, owner=CLIENT)                  # the owner's public decision

`visibility` has the structure of the argument pytree (a prefix is enough: one flag for a
whole subtree). `run` returns a `RunCost` of the whole run (every party's SPU profile,
combined: bytes summed over the parties, each party's own in `cost.parties`) or None for XLA.
Shared values of one backend can be fed to any of its programs: the KV cache and the weights
stay secret-shared from step to step; only what the caller reveals is reconstructed.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import queue
import re
import tempfile
import threading
import time
import weakref
from typing import Any, Callable

import jax
import numpy as np

from mpcache_jax.primitives import secure_trace
from runtime.mpc.config import MPCConfig
from runtime.mpc.profile_log import RunCost, party_executable_name, read_run_profiles
from runtime.programs import (PUBLIC, SECRET, broadcast_visibility,
                              dependency_visibility)

# Input owners (hints only: SPU may co-locate a share with its owner).
SERVER = 0   # holds the weights
CLIENT = 1   # holds the prompt and receives the sampled tokens
BACKENDS = ("xla", "spu_sim")


@dataclasses.dataclass
class Program:
    """A compiled function: `executable` (SPU) or jitted callable (XLA), input/output trees."""

    name: str
    in_tree: Any
    out_tree: Any
    visibility: list
    executable: Any = None
    ir: str = ""
    out_visibility: list = dataclasses.field(default_factory=list)
    out_shapes: list = dataclasses.field(default_factory=list)   # ShapeDtypeStruct per output


@dataclasses.dataclass(eq=False)
class Shared:
    """Handle on one secret-shared (or public) array held by the parties' runtimes under
    `name` (its shares never come back to Python unless revealed). Freed when collected."""

    name: str
    shape: tuple | None
    dtype: Any
    visibility: str


class _Parties:
    """One long-lived thread per party, each with its SPU runtime and link: values set once
    (weights, the KV cache) stay in the runtimes across programs, as in a deployment. Every
    party's runtime gets the same config (so every party profiles its runs when asked)."""

    def __init__(self, libspu, spu_api, world: int, rt_config):
        self.world = world
        self.queues = [queue.Queue() for _ in range(world)]
        self.replies = [queue.Queue() for _ in range(world)]
        desc = libspu.link.Desc()
        for rank in range(world):
            desc.add_party(f"id_{rank}", f"thread_{rank}")

        def serve(rank):
            link = libspu.link.create_mem(desc, rank)
            rt = spu_api.Runtime(link, libspu.RuntimeConfig(rt_config))
            while True:
                job = self.queues[rank].get()
                if job is None:
                    return
                try:
                    self.replies[rank].put((True, job(rank, rt)))
                except BaseException as err:  # surfaced in the caller's thread
                    self.replies[rank].put((False, err))

        self.threads = [threading.Thread(target=serve, args=(r,), daemon=True)
                        for r in range(world)]
        for t in self.threads:
            t.start()
        # Names of values to delete, queued by `release` and deleted by the next `call`.
        self.released: collections.deque = collections.deque()

    def release(self, name: str) -> None:
        """Delete variable `name` from every runtime with the next call. A handle's finalizer
        runs wherever the garbage collector does: on a party's own thread (waiting there for
        that party's reply would never end) or inside another call (whose replies a nested
        call would take); so it only queues the name."""
        self.released.append(name)

    def call(self, job: Callable) -> list:
        """Run job(rank, runtime) on every party at once; results in rank order."""
        names = []
        while self.released:
            names.append(self.released.popleft())
        if names:
            job = functools.partial(_delete_then, names, job)
        for q in self.queues:
            q.put(job)
        replies = [q.get() for q in self.replies]
        for ok, value in replies:
            if not ok:
                raise value
        return [value for _, value in replies]

    def close(self):
        for q in self.queues:
            q.put(None)


def _delete_then(names: list, job: Callable, rank: int, rt):
    for name in names:
        try:
            rt.del_var(name)
        except Exception:   # (already gone)
            pass
    return job(rank, rt)


class XLABackend:
    """Plaintext reference: the same function jitted by XLA; share/reveal are identities."""

    name = "xla"
    config = None

    def compile(self, fn: Callable, args: tuple, visibility) -> Program:
        flat, in_tree = jax.tree_util.tree_flatten(args)
        vis = broadcast_visibility(visibility, args)
        out_vis = dependency_visibility(fn, args, visibility)
        jitted = jax.jit(lambda *leaves: fn(*jax.tree_util.tree_unflatten(in_tree, leaves)))
        return Program(getattr(fn, "__name__", "fn"), in_tree,
                       jax.tree_util.tree_structure(out_vis), vis, jitted,
                       out_visibility=jax.tree_util.tree_leaves(out_vis))

    def share(self, tree, visibility=SECRET, owner: int = -1):
        del visibility, owner
        return tree

    def to_visibility(self, tree, visibility):
        return tree

    def run(self, program: Program, *args):
        leaves = jax.tree_util.tree_leaves(args)
        start = time.perf_counter()
        out = program.executable(*leaves)
        jax.block_until_ready(out)
        return out, None, time.perf_counter() - start

    def reveal(self, tree, to: int | None = None):
        del to
        return jax.tree_util.tree_map(np.asarray, tree)

    def agree(self, value, owner: int):
        del owner
        return value


class SpuSimBackend:
    """SPU's protocols with all parties as threads of this process (in-memory links).

    Each party keeps one runtime for the backend's lifetime; shared values live in the
    runtimes (Shared handles). Every party's runtime profiles every run (party r runs the
    program as an executable named `NAME.r{r}`, so its profile says whose it is); the log lines
    go to one file per process (set up on first use) and are parsed after each run into one
    RunCost per party, combined into the run's (`profile_log.read_run_profiles`)."""

    name = "spu_sim"
    _log_lock = threading.Lock()
    _log_path: str | None = None
    _counter = itertools.count()

    def __init__(self, config: MPCConfig, profile: bool = True):
        import spu.libspu as libspu
        from spu import api as spu_api
        self.libspu, self.spu_api = libspu, spu_api
        self.config = config
        self.profile = profile
        self.world = config.parties
        self.rt_config = config.runtime_config(profile=profile)
        self.io = spu_api.Io(self.world, self.rt_config)
        if profile:
            self._setup_logging()
        self.parties = _Parties(libspu, spu_api, self.world, self.rt_config)
        self._finalizer = weakref.finalize(self, self.parties.close)

    @classmethod
    def _setup_logging(cls):
        with cls._log_lock:
            if cls._log_path is None:
                import spu.libspu as libspu
                path = os.path.join(tempfile.mkdtemp(prefix="mpcache_spu_"), "spu.log")
                opts = libspu.logging.LogOptions()
                opts.enable_console_logger = False
                opts.system_log_path = path
                libspu.logging.setup_logging(opts)
                cls._log_path = path

    # ----- compile --------------------------------------------------------------------------
    def compile(self, fn: Callable, args: tuple, visibility, allow_reveals: bool = False
                ) -> Program:
        return compile_spu(fn, args, visibility, allow_reveals)

    # ----- data -----------------------------------------------------------------------------
    def _handle(self, shape, dtype, visibility) -> Shared:
        handle = Shared(f"v{next(self._counter)}", shape, dtype, visibility)
        weakref.finalize(handle, self._free, handle.name)
        return handle

    def _free(self, name: str):
        if self._finalizer.alive:
            self.parties.release(name)

    def share(self, tree, visibility=SECRET, owner: int = -1):
        """Secret-share (or publicly encode) every leaf into the parties' runtimes; `owner` is
        the providing party (a hint SPU may use to co-locate a share)."""
        vis = broadcast_visibility(visibility, tree)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        out = []
        for leaf, v in zip(leaves, vis):
            arr = np.asarray(leaf)
            kind = (self.libspu.Visibility.VIS_SECRET if v == SECRET
                    else self.libspu.Visibility.VIS_PUBLIC)
            shares = self.io.make_shares(arr, kind, owner)
            handle = self._handle(arr.shape, arr.dtype, v)
            self.parties.call(lambda rank, rt, n=handle.name, s=shares: rt.set_var(n, s[rank]))
            del shares
            out.append(handle)
        return jax.tree_util.tree_unflatten(treedef, out)

    def to_visibility(self, tree, visibility):
        """Re-encode public leaves that a program takes as secret (public data may always be
        secret-shared). A secret leaf asked to become public is an error (it would leak)."""
        return convert_visibility(tree, visibility, lambda leaf: self.share(
            np.asarray(self._reconstruct(leaf)), SECRET))

    def _reconstruct(self, handle: Shared):
        return self.io.reconstruct(self.parties.call(lambda rank, rt: rt.get_var(handle.name)))

    def reveal(self, tree, to: int | None = None):
        """Reconstruct every Shared leaf (in a deployment only `to`, the output owner, gets
        the value; the simulator plays every party)."""
        del to
        return jax.tree_util.tree_map(self._reconstruct, tree,
                                      is_leaf=lambda x: isinstance(x, Shared))

    def agree(self, value, owner: int):
        """A public decision of `owner` (the simulator plays every party)."""
        del owner
        return value

    # ----- run ------------------------------------------------------------------------------
    def run(self, program: Program, *args):
        """Run on shared inputs. Returns (outputs as Shared handles, RunCost, wall_s)."""
        leaves = jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, Shared))
        if any(not isinstance(x, Shared) for x in leaves):
            raise TypeError("SpuSimBackend.run takes shared inputs: call backend.share first")
        if len(leaves) != len(program.visibility):
            raise ValueError(f"{program.name} takes {len(program.visibility)} inputs, got "
                             f"{len(leaves)}")
        for i, (x, v) in enumerate(zip(leaves, program.visibility)):
            if x.visibility != v:
                raise ValueError(f"input {i} of {program.name} was shared as {x.visibility} but "
                                 f"the program was compiled for {v}")
        outs = [self._handle(None, None, vis) for vis in program.out_visibility]
        exes = [self.libspu.Executable(name=party_executable_name(program.name, rank),
                                       input_names=[x.name for x in leaves],
                                       output_names=[o.name for o in outs],
                                       code=program.executable.code)
                for rank in range(self.world)]
        with self._log_lock:
            offset = self._log_size()
            start = time.perf_counter()
            self.parties.call(lambda rank, rt: rt.run(exes[rank]))
            wall = time.perf_counter() - start
            cost = self._read_cost(offset) if self.profile else None
        return jax.tree_util.tree_unflatten(program.out_tree, outs), cost, wall

    def _log_size(self) -> int:
        path = self._log_path
        return os.path.getsize(path) if path and os.path.exists(path) else 0

    def _read_cost(self, offset: int) -> RunCost:
        return read_run_profiles(self._log_path, offset, self.world, timeout_s=10.0)


def convert_visibility(tree, visibility, make_secret: Callable[["Shared"], "Shared"]):
    """`tree` of Shared handles with each leaf at the visibility a program takes: a public leaf
    that must be secret becomes `make_secret(leaf)` (a fresh sharing of the public value); a
    secret leaf asked to become public is refused (it would leak)."""
    flags = broadcast_visibility(visibility, tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Shared))
    out = []
    for leaf, want in zip(leaves, flags):
        if leaf.visibility == want:
            out.append(leaf)
        elif want == PUBLIC:
            raise ValueError("refusing to make a secret value public")
        else:
            out.append(make_secret(leaf))
    return jax.tree_util.tree_unflatten(treedef, out)


class RevealingProgram(ValueError):
    """A compiled program makes a secret public before its outputs."""


def compile_spu(fn: Callable, args: tuple, visibility, allow_reveals: bool = False) -> Program:
    """SPU executable of `fn` for example `args` (arrays or ShapeDtypeStructs) whose leaves
    have the given visibility; the output visibility is read from the compiled module. A
    program that reveals a secret before its outputs (`secret_reveals`) is refused unless
    `allow_reveals` (tests of the check itself)."""
    import spu.libspu as libspu
    from spu.utils import frontend as spu_fe
    flat, in_tree = jax.tree_util.tree_flatten(args)
    vis = broadcast_visibility(visibility, args)
    spu_vis = [libspu.Visibility.VIS_SECRET if v == SECRET else libspu.Visibility.VIS_PUBLIC
               for v in vis]
    name = getattr(fn, "__name__", "fn")

    def flat_fn(*leaves):
        return fn(*jax.tree_util.tree_unflatten(in_tree, leaves))
    flat_fn.__name__ = name
    flat = [np.asarray(x) if not isinstance(x, jax.ShapeDtypeStruct) else x for x in flat]
    with secure_trace():   # one-hot products where plaintext programs gather by index
        executable, out_info = spu_fe.compile(
            spu_fe.Kind.JAX, flat_fn, flat, {}, [f"{name}_in{i}" for i in range(len(flat))],
            spu_vis, lambda outs: [f"{name}_out{i}" for i in range(len(outs))])
    ir = executable.code.decode("utf-8")
    leaks = secret_reveals(ir)
    if leaks and not allow_reveals:
        raise RevealingProgram(f"program {name!r} reveals a secret before its outputs "
                               f"({len(leaks)} op(s), e.g. {leaks[0][:160]}); refusing to run it")
    return Program(name, in_tree, jax.tree_util.tree_structure(out_info), vis, executable, ir,
                   output_visibility(ir), jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))


# ----- leakage check ------------------------------------------------------------------------
_DEF = re.compile(r"^\s*(?P<res>%[\w#:]+(?:\s*,\s*%[\w#:]+)*)\s*=\s*(?P<body>.*)$")
_VALUE = re.compile(r"%[\w]+(?:#\d+)?")


def secret_reveals(ir: str) -> list[str]:
    """Lines of a compiled pphlo module where a secret operand yields a public result (a
    reveal inside the program), plus any explicit reveal custom call. Empty = the program only
    makes public what was public on input.

    Value names are scoped by region: the branches of a `pphlo.if` (and other region ops)
    number their values anew, and the enclosing region reuses those numbers after it closes.
    A region op's results get their types on the line that closes its last region."""
    scopes: list[set[str]] = [set()]
    pending: list[list[str]] = []     # results of open region ops, typed when they close
    bad = []

    def is_secret(name: str) -> bool:
        # "%64#4" is result 4 of a multi-result op; a single-result op's name has no "#"
        base = name.split("#")[0]
        return any(name in scope or base in scope for scope in scopes)

    def expand(res: str) -> list[str]:
        """"%a, %b" -> [%a, %b]; "%64:5" -> [%64#0 .. %64#4], each result typed on its own."""
        names = []
        for r in res.split(","):
            name, _, count = r.strip().partition(":")
            names += [f"{name}#{i}" for i in range(int(count))] if count else [name]
        return names

    def mark(results: list[str], types: list[str]) -> None:
        if len(types) == len(results):
            scopes[-1].update(r for r, t in zip(results, types) if "secret" in t)
        elif any("secret" in t for t in types):
            scopes[-1].update(results)

    for line in ir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            if len(scopes) > 1:
                scopes.pop()
            if text.endswith("{"):            # "}, {": the next region of the same op
                scopes.append(set())
            elif pending and "->" in text:
                mark(pending.pop(), _split_types(text.rsplit("->", 1)[1].strip().strip("()")))
            continue
        if "func.func" in line or "reducer(" in line or text.startswith("^"):
            if text.endswith("{"):
                scopes.append(set())
            for name, typ in re.findall(r"(%\w+): (tensor<[^>]*(?:<[^>]*>)?[^>]*>)", line):
                if "secret" in typ:
                    scopes[-1].add(name)
            continue
        if "reveal" in line:
            bad.append(text)
            continue
        m = _DEF.match(line)
        if not m:
            if text.endswith("{"):
                scopes.append(set())
            continue
        results = expand(m["res"])
        body = m["body"]
        if body.startswith("pphlo.while("):
            # Loop-carried values: initial value i becomes region argument i (seen by the cond
            # and body regions below) and result i, all of type i. A position is a reveal only
            # if its initial value is secret and its type public; the regions are checked op
            # by op with their arguments' visibility.
            head, _, type_list = body.rpartition(" : ")
            pairs = re.findall(r"(%\w+) = (%[\w#]+)", head)
            types = _split_types(type_list)
            if len(pairs) != len(types):
                bad.append(text)
            for (arg, init), typ in zip(pairs, types):
                if "secret" in typ:
                    scopes[-1].add(arg)
                elif is_secret(init):
                    bad.append(text)
            mark(results, types)
            continue
        if text.endswith("({"):                # a region op: typed when its regions close
            pending.append(results)
            scopes.append(set())
            continue
        type_part = body.rsplit("->", 1)[1] if "->" in body else body.rsplit(" : ", 1)[-1]
        operands = _VALUE.findall(body.split(" : ")[0])
        if body.startswith("pphlo.broadcast_as"):
            operands = operands[:1]   # the second operand only lends its shape
        secret_in = any(is_secret(v) for v in operands)
        result_types = re.findall(r"tensor<[^ ]*", type_part)
        mark(results, result_types)
        if secret_in and any("secret" not in t for t in result_types):
            bad.append(text)
    return bad


def output_visibility(ir: str) -> list[str]:
    """SECRET/PUBLIC per output of a compiled pphlo module (from `func @main`'s result types)."""
    sig = next(line for line in ir.splitlines() if "func.func @main" in line)
    results = sig.split(") -> ", 1)[1].rsplit("{", 1)[0].strip()
    if results.startswith("("):
        results = results[1:-1]
    types = _split_types(results)
    return [SECRET if "secret" in t else PUBLIC for t in types]


def _split_types(text: str) -> list[str]:
    """Split a comma-separated list of MLIR types, respecting <...> nesting."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def make_backend(name: str, config: MPCConfig | None = None, profile: bool = True):
    """`xla` (plaintext) or `spu_sim` (SPU protocols, in-process parties)."""
    if name == "xla":
        return XLABackend()
    if name == "spu_sim":
        return SpuSimBackend(config or MPCConfig(), profile=profile)
    raise ValueError(f"unknown backend {name!r}; use one of {BACKENDS}")
