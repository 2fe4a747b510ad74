"""One party of a multi-process SPU run, behind the backend interface of `mpc.backends`.

Every party runs the same session loop (`mpc.secure.SecureSession`) on its own NodeBackend, in
lockstep: programs are compiled by every party from the public job and must be identical
(SHA-256 compared) and reveal nothing before their outputs (`secret_reveals`); an input is
secret-shared by its owner, one typed message per peer and value (`wire`); shares stay in this
party's SPU runtime between programs (the weights once per session, the KV cache from step to
step); a revealed value goes to its owner only; public decisions (stop generating) come from
their owner. Roles: owner SERVER = the node config's MODEL_OWNER, CLIENT = its PROMPT_OWNER.
"""
from __future__ import annotations

import hashlib
import itertools
import time
import weakref
from typing import Callable

import jax
import numpy as np

from runtime.distributed import wire
from runtime.distributed.costs import run_cost_from_json, run_cost_to_json
from runtime.mpc.backends import (CLIENT, SERVER, Program, Shared, compile_spu,
                                  convert_visibility)
from runtime.mpc.profile_log import combine_parties, read_last_profile
from runtime.programs import PUBLIC, SECRET, broadcast_visibility


class ProgramMismatch(RuntimeError):
    """The parties compiled different programs."""


class NodeBackend:
    """`compile / share / run / reveal / agree / to_visibility` for this party."""

    name = "spu_nodes"

    def __init__(self, config, party_id: str, channel, log_path):
        import spu
        self.config, self.party_id, self.chan = config, party_id, channel
        self.rank, self.world = config.rank(party_id), config.world_size
        self.rt_config = config.mpc.runtime_config(profile=True)
        self.io = spu.Io(self.world, self.rt_config)
        self.runtime = spu.Runtime(channel.ctx, self.rt_config)
        self.log_path = log_path
        self._counter = itertools.count()
        self._reference: dict = {}
        self.stage = "start-up"   # what the party is doing (for messages and the watchdog)

    # ----- roles --------------------------------------------------------------------------------
    def party_of(self, owner) -> str:
        if owner == SERVER:
            return self.config.model_owner
        if owner == CLIENT:
            return self.config.prompt_owner
        raise ValueError(f"owner {owner!r}: use mpc.SERVER or mpc.CLIENT")

    @property
    def peers(self) -> list[str]:
        return [p for p in self.config.party_ids if p != self.party_id]

    def exchange(self, name: str, value) -> list:
        """All parties' JSON value of `name`, in rank order (this party's included)."""
        gathered = self.chan.all_gather(wire.json_text(name, value), f"exchanging {name}")
        return [wire.from_json_text(g, name, pid)
                for g, pid in zip(gathered, self.config.party_ids)]

    # ----- compile ------------------------------------------------------------------------------
    def compile(self, fn: Callable, args: tuple, visibility) -> Program:
        """Compile with SPU here (`compile_spu` refuses a program that reveals a secret before
        its outputs); every party must get the same program (SHA-256 of the pphlo module)."""
        program = compile_spu(fn, args, visibility)
        digest = hashlib.sha256(program.executable.code).hexdigest()
        digests = self.exchange(f"program {program.name}", digest)
        if len(set(digests)) != 1:
            differing = [p for p, d in zip(self.config.party_ids, digests) if d != digest]
            raise ProgramMismatch(f"parties {differing} compiled a different {program.name!r} "
                                  f"program than {self.party_id} ({digest[:12]}): every party "
                                  "must run the same code and job")
        return program

    # ----- data ---------------------------------------------------------------------------------
    def _handle(self, shape, dtype, visibility) -> Shared:
        """A runtime variable name; every party creates them in the same order (lockstep), so
        the names agree across parties."""
        handle = Shared(f"v{next(self._counter)}", shape, dtype, visibility)
        weakref.finalize(handle, _delete_var, weakref.ref(self.runtime), handle.name)
        return handle

    def _spec(self, name: str, shape, dtype) -> wire.ShareSpec:
        """What the owner's share of a secret input must look like (scaled from a
        one-element share made here)."""
        import spu
        key = np.dtype(dtype).str
        if key not in self._reference:
            share = self.io.make_shares(np.zeros((1,), dtype), spu.Visibility.VIS_SECRET,
                                        0)[self.rank]
            content = sum(wire.chunk_content_size(bytes(c)) for c in share.share_chunks)
            self._reference[key] = (bytes(share.meta), content)
        meta, per_element = self._reference[key]
        return wire.ShareSpec.for_input(name, shape, meta, per_element)

    def share(self, tree, visibility=SECRET, owner: int = -1):
        """Secret-share every leaf from its owner (a value there; a ShapeDtypeStruct on the
        other parties), one typed message per peer and leaf; public leaves are encoded by
        every party itself (public data is known to all)."""
        import spu
        flags = broadcast_visibility(visibility, tree)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        sender = self.party_of(owner) if owner in (SERVER, CLIENT) else None
        out = []
        for leaf, vis in zip(leaves, flags):
            known = not isinstance(leaf, jax.ShapeDtypeStruct)
            shape, dtype = np.shape(leaf), (leaf.dtype if not known else np.asarray(leaf).dtype)
            handle = self._handle(tuple(shape), np.dtype(dtype), vis)
            if vis == PUBLIC:
                if not known:
                    raise ValueError("a public input must be known to every party")
                share = self.io.make_shares(np.asarray(leaf), spu.Visibility.VIS_PUBLIC)[self.rank]
            elif sender is None:
                raise ValueError("a secret input needs its owner (mpc.SERVER or mpc.CLIENT)")
            elif sender == self.party_id:
                if not known:
                    raise ValueError(f"party {self.party_id} owns this input but has no value")
                shares = self.io.make_shares(np.asarray(leaf), spu.Visibility.VIS_SECRET,
                                             owner_rank=self.rank)
                for peer in self.peers:
                    self.chan.send(peer, wire.encode_share(handle.name,
                                                           shares[self.config.rank(peer)]),
                                   f"sending {self.stage} shares")
                share = shares[self.rank]
            else:
                spec = self._spec(handle.name, shape, dtype)
                share = wire.decode_share(self.chan.recv(sender, f"receiving {self.stage} shares"),
                                          spec, sender)
            self.runtime.set_var(handle.name, share)
            out.append(handle)
        return jax.tree_util.tree_unflatten(treedef, out)

    def to_visibility(self, tree, visibility):
        """Re-share public leaves that a program takes as secret (the client shares the
        public value); a secret leaf asked to become public is an error (it would leak)."""
        def make_secret(leaf):
            mine = self.runtime.get_var(leaf.name)
            value = np.asarray(self.io.reconstruct([mine] * self.world))
            return self.share(value, SECRET, owner=CLIENT)
        return convert_visibility(tree, visibility, make_secret)

    def reveal(self, tree, to: int | None = None):
        """Values of the Shared leaves for `to` (its owner role); None on every other party.
        Each party sends its share of every leaf to that party only."""
        if to is None:
            raise ValueError("a multi-party run reveals to one owner (mpc.CLIENT or mpc.SERVER)")
        target = self.party_of(to)
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Shared))
        values = []
        for leaf in leaves:
            mine = self.runtime.get_var(leaf.name)
            if self.party_id != target:
                self.chan.send(target, wire.encode_share(leaf.name, mine), "sending output shares")
                values.append(None)
                continue
            # A peer's share must look exactly like this party's own share of the same value.
            spec = wire.ShareSpec.like(leaf.name, mine)
            shares = {self.party_id: mine}
            for peer in self.peers:
                message = self.chan.recv(peer, "receiving output shares")
                shares[peer] = wire.decode_share(message, spec, peer)
            values.append(np.asarray(self.io.reconstruct(
                [shares[p] for p in self.config.party_ids])))
        if self.party_id != target:
            return None
        return jax.tree_util.tree_unflatten(treedef, values)

    def agree(self, value, owner: int):
        """The owner's public decision, sent to every party (a JSON message)."""
        source = self.party_of(owner)
        if self.party_id == source:
            for peer in self.peers:
                self.chan.send(peer, wire.encode_json("decision", value), "sending a decision")
            return value
        return wire.decode_json(self.chan.recv(source, "receiving a decision"), "decision", source)

    # ----- run ----------------------------------------------------------------------------------
    def run(self, program: Program, *args):
        """Run on shared inputs -> (outputs as Shared handles, RunCost of every party, wall_s).
        Each party measures its own profile; the parties exchange them (public)."""
        import spu.libspu as libspu
        leaves = jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, Shared))
        if len(leaves) != len(program.visibility):
            raise ValueError(f"{program.name} takes {len(program.visibility)} inputs, got "
                             f"{len(leaves)}")
        for i, (x, v) in enumerate(zip(leaves, program.visibility)):
            if not isinstance(x, Shared) or x.visibility != v:
                raise ValueError(f"input {i} of {program.name} must be a {v} shared value")
        outs = [self._handle(tuple(s.shape), s.dtype, vis)
                for s, vis in zip(program.out_shapes, program.out_visibility)]
        ex = libspu.Executable(name=program.name, input_names=[x.name for x in leaves],
                               output_names=[o.name for o in outs], code=program.executable.code)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        start, cpu_start = time.perf_counter(), time.process_time()
        self.runtime.run(ex)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        mine = read_last_profile(self.log_path, offset)
        mine.rank, mine.cpu_s = self.rank, cpu
        costs = self.exchange(f"cost of {program.name}", run_cost_to_json(mine))
        runs = [run_cost_from_json(c, p) for c, p in zip(costs, self.config.party_ids)]
        return jax.tree_util.tree_unflatten(program.out_tree, outs), combine_parties(runs), wall


def _delete_var(runtime_ref, name: str) -> None:
    runtime = runtime_ref()
    if runtime is not None:
        try:
            runtime.del_var(name)
        except Exception:   # the runtime is shutting down
            pass
