"""Sequence parallelism: a group of devices shares each DiT block, each device holding all of
the block's weights and a slice of the tokens.

A lone request on a DiT has one or two rows, so splitting rows leaves devices idle (FLUX.1-dev
has one row: its guidance is embedded). Splitting its tokens keeps every device busy on that
one call. Each rank walks its own replica's shard (the same blocks, on its own devices) with
its slice of the image and text tokens (`SequenceSplit`: which blocks, which entries); every
op of a transformer block is per token except attention, where the ranks exchange:

- **Ulysses** (the heads divide by the degree): an all-to-all hands rank r every token of its
  share of the heads; attention runs over all tokens for H/D heads; a second all-to-all hands
  each rank back its own tokens of every head;
- **KV gather** (they do not): every rank gathers all keys and values and attends its own
  queries over them. Ring attention computes the same result, passing the blocks of keys
  around a ring to overlap transfer with compute; in one process the gather is a copy, so we
  do not need the ring's overlap here (on GPUs it would hide the copies: not built).

The ranks are threads of this process (rank 0 the lane's own, the others its helper threads),
exchanging through a barrier, not processes over `torch.distributed` (diffusers' context
parallelism): every rank then reads the same call plan (rows, adapters, cache decisions) with
no step-by-step messages, CPU ranks share one copy of the weights, and a step batches requests
as any other call does. `benchmarks.parallel.sequence` measures both.

A flow enters the split blocks whole (every rank has it: the embedding ran on every rank) and
each rank takes its slice without moving anything; it leaves them gathered (each rank gets the
whole again) before any block that is not split, and wherever the walker reads every token
(step caching's decisions).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from server.engine.denoisers.blocks import Flow, SequenceSplit, map_rows
from server.engine.hardware.devices import device_set
from server.engine.runtime.call import CallPlan, CallResult
from server.errors import GroupBroken, WorkerLost

# A rank waits at most this long for the others at one exchange (they are one block's attention
# apart: seconds, even on a CPU). Past it the group is broken (GroupBroken on every rank): a rank
# lost before it started can no longer hold its peers' threads, and the process's exit, forever.
EXCHANGE_TIMEOUT_S = 300.0


class Group:
    """One call's ranks and their in-process all-gather: each rank leaves its value in its slot
    and waits at the barrier; slots alternate between two sets, so a rank that runs ahead to
    its next exchange never overwrites what a slower one is still reading (one barrier an
    exchange)."""

    def __init__(self, devices: Sequence[torch.device], timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.size = len(self.devices)
        self._barrier = threading.Barrier(self.size, timeout=timeout_s)
        self._slots: tuple[list[Any], list[Any]] = ([None] * self.size, [None] * self.size)
        self.exchange_s = 0.0  # rank 0's seconds in exchanges: waiting for the others and copying
        self.exchanges = 0  # rank 0's exchanges this call

    def all_gather(self, rank: int, turn: int, value: Any) -> list[Any]:
        device = self.devices[rank]
        if device.type == "cuda" and torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
            # a peer reads this value once the barrier says it is made: true only when every
            # rank's work is on its GPU's default stream (the others' wait for it)
            raise RuntimeError(f"an exchange on {device} needs every rank's work on the default stream")
        slots = self._slots[turn % 2]
        slots[rank] = value
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise GroupBroken("another rank of the sequence group failed during this call") from None
        # every rank has read the last exchange (it came to this one after): drop this rank's
        # value of it, not held on through the next (Ulysses' q/k/v, a tensor group's partials)
        self._slots[(turn + 1) % 2][rank] = None
        return list(slots)

    def abort(self) -> None:
        """Wake every rank waiting (they raise `GroupBroken`): one rank failed."""
        self._barrier.abort()


def chunks(length: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` near-equal slices of `length` (the first ones longer),
    as `torch.tensor_split` cuts."""
    base, extra = divmod(length, parts)
    bounds, at = [], 0
    for index in range(parts):
        size = base + (index < extra)
        bounds.append((at, at + size))
        at += size
    return bounds


class Rank:
    """This thread's place in one call's group: its index and device, the split it runs, and
    the exchanges it has made (their order is the same on every rank)."""

    def __init__(self, group: Group, index: int, split: SequenceSplit) -> None:
        self.group, self.index, self.split = group, index, split
        self._turn = 0

    @property
    def size(self) -> int:
        return self.group.size

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (a collective: every rank must call it)."""
        started = time.perf_counter()
        got = self.group.all_gather(self.index, self._turn, value)
        self._turn += 1
        if self.index == 0:
            self.group.exchange_s += time.perf_counter() - started
            self.group.exchanges += 1
        return got

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (so ranks never part ways on a decision)."""
        return self.gather(value)[0]

    # Flows.

    def cut(self, flow: Flow) -> Flow:
        """This rank's slice of a whole flow (a view: nothing moves)."""
        rows, cuts = dict(flow.rows), {}
        for key, dim in self.split.tokens.items():
            value = rows.get(key)  # a tensor, or a tuple of them (a ControlNet's residuals; None: none)
            first = value if not isinstance(value, tuple) else next((t for t in value if t is not None), None)
            if first is None:
                continue
            length = first.shape[dim]
            start, stop = chunks(length, self.size)[self.index]
            rows[key] = map_rows(value, lambda t, d=dim, s=start, n=stop - start: t.narrow(d, s, n))
            cuts[key] = (start, stop, length)
        shared = self.split.shared(flow.shared, cuts) if self.split.shared else flow.shared
        return Flow(rows, shared)

    def join(self, flow: Flow, shared: dict[str, Any]) -> Flow:
        """The whole flow again from every rank's slice (an all-gather), with the whole `shared`."""
        mine = {k: flow.rows[k] for k in self.split.tokens if flow.rows.get(k) is not None}
        everyone = self.gather(mine)
        rows = dict(flow.rows)
        for key, dim in self.split.tokens.items():
            if key in mine:
                rows[key] = _joined([part[key] for part in everyone], dim, self.group.devices[self.index])
        return Flow(rows, shared)

    # Attention.

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """`F.scaled_dot_product_attention` of this rank's queries ([B, H, S_r, d]) over every
        rank's tokens; returns this rank's tokens of the output. A mask may only mask keys
        ([B, 1, 1, S_r]: a padded prompt's tokens), gathered as the keys are; a mask of pairs
        is taken as its keys' (`keys_of`)."""
        if is_causal or dropout_p or enable_gqa:
            raise ValueError("sequence-parallel attention takes no causality, dropout or GQA")
        if attn_mask is not None and attn_mask.shape[-2] != 1:
            attn_mask = keys_of(attn_mask)
        if query.shape[1] % self.size == 0:
            return self._ulysses(query, key, value, attn_mask, scale)
        keys = self.gather((key, value, attn_mask))
        here = query.device  # this rank's stage's device
        k = torch.cat([part[0].to(here) for part in keys], dim=2)
        v = torch.cat([part[1].to(here) for part in keys], dim=2)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=_keys_mask(keys, 2, here), scale=scale)

    def _ulysses(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        parts = self.gather((q, k, v, mask))
        start, stop = chunks(q.shape[1], self.size)[self.index]
        here = q.device  # this rank's stage's device

        def heads(which: int) -> torch.Tensor:  # my heads, every rank's tokens (rank order)
            return torch.cat([p[which][:, start:stop].to(here) for p in parts], dim=2)

        mask = _keys_mask(parts, 3, here)
        out = F.scaled_dot_product_attention(heads(0), heads(1), heads(2), attn_mask=mask, scale=scale)
        outs = self.gather(out)
        lengths = [p[0].shape[2] for p in parts]
        begin = sum(lengths[: self.index])
        mine = slice(begin, begin + lengths[self.index])
        return torch.cat([o[:, :, mine].to(here) for o in outs], dim=1)

    def attention(self, block: str) -> SequenceAttention:
        """While split block `block` runs on this rank: its attention over every rank's tokens."""
        return SequenceAttention(self)


def _joined(parts: list[Any], dim: int, here: torch.device) -> Any:
    """Every rank's slice of an entry (a tensor, or a tuple of them: a ControlNet's residuals)
    joined along its token `dim` on `here`, this rank's device (the first part is rank 0's: a
    join there ran rank k's later blocks on rank 0's GPU)."""
    if isinstance(parts[0], tuple):
        return tuple(_joined(list(each), dim, here) for each in zip(*parts, strict=True))
    if parts[0] is None:
        return None
    return torch.cat([part.to(here) for part in parts], dim=dim)


def keys_of(mask: torch.Tensor) -> torch.Tensor:
    """A joint attention's mask of (query, key) pairs, [B, 1, S, S], kept where both tokens are
    valid (HunyuanVideo-1.5's processor builds it from its text mask), as the mask of its keys,
    [B, 1, 1, S]: each valid query's row. Valid queries attend as they did; a padded query (its
    row all masked: zeros) attends the valid keys instead, which reaches no valid token, since as
    a key it stays masked, and its output is dropped at the end. A rank's slice always holds
    valid queries (its video tokens), so the rows' union is the keys' mask."""
    if mask.dtype != torch.bool:
        raise ValueError("sequence-parallel attention takes a boolean mask of pairs, or a mask of keys")
    return mask.any(dim=-2, keepdim=True)


def _keys_mask(parts: Sequence[tuple], at: int, device: torch.device) -> torch.Tensor | None:
    """Every rank's mask of its keys (entry `at` of what each gathered), joined as the keys are."""
    if parts[0][at] is None:
        return None
    return torch.cat([p[at].to(device) for p in parts], dim=-1)


class SequenceAttention(TorchFunctionMode):
    """While a rank runs a split block: its attention goes through `Rank.attend`. A mode is
    this thread's only (the other ranks and lanes are untouched), and it sees whatever calls
    `F.scaled_dot_product_attention`, so the attention processors of diffusers stay as they are."""

    def __init__(self, rank: Rank) -> None:
        super().__init__()
        self.rank = rank

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.rank.attend(*args, **kwargs)
        return func(*args, **kwargs)


Submit = Callable[..., Any]  # a lane's helper threads: `Workers.submit(fn, *args) -> Future`


def run_sequence(
    shards: Sequence[Any], split: SequenceSplit, inputs: Any, plan: CallPlan, submit: Submit
) -> CallResult:
    """One call of `plan` with its tokens split over `shards` (one rank each, rank 0 on this
    thread); rank 0's result."""
    return run_ranks(shards, lambda group, index: Rank(group, index, split), inputs, plan, submit)


def run_ranks(
    shards: Sequence[Any], rank_of: Callable[[Group, int], Any], inputs: Any, plan: CallPlan, submit: Submit
) -> CallResult:
    """One call of `plan` over a group of `shards`, each walking as `rank_of(group, index)` (a
    sequence group's or a tensor group's rank), rank 0 on this thread; rank 0's result. A rank
    that fails wakes the others, and the first real failure (not another rank's `GroupBroken`)
    is raised."""
    group = Group([shard.device for shard in shards])

    def run(index: int) -> CallResult:
        try:
            with device_set(shards[index].device):
                return shards[index].run(inputs, plan, rank=rank_of(group, index))
        except BaseException:
            group.abort()
            raise

    others = [submit(run, index) for index in range(1, len(shards))]
    for future in others:  # a helper that dies before its rank runs must wake the others too
        future.add_done_callback(lambda f: group.abort() if f.exception() is not None else None)
    errors: list[BaseException] = []
    try:
        first = run(0)
    except BaseException as err:
        errors.append(err)
    finally:  # nothing of this call runs on after it ends
        errors += [e for e in (f.exception() for f in others) if e is not None]
    if errors:
        raise first_failure(errors)
    first.exchange_s = group.exchange_s
    return first


class SequenceGroup:
    """Shards that run each call as one sequence group: a shard to `run_micro_batches`, so a
    call's rows can go to several groups at once (a guided image's halves, each split by tokens)."""

    def __init__(self, shards: Sequence[Any], split: SequenceSplit, submit: Submit) -> None:
        self.shards, self.split, self.submit = list(shards), split, submit
        self.device = self.shards[0].device

    def run(self, inputs: Any, plan: CallPlan) -> CallResult:
        return run_sequence(self.shards, self.split, inputs, plan, self.submit)


def groups_for(shards: Sequence[Any], rows: int, every_call: bool) -> list[list[Any]]:
    """How a call of `rows` rows uses `shards` (its own first, then idle replicas): each part
    of its rows on a group of them (`ranks` ≥ 2 each), or [] for its rows split alone. Rows that
    fill the shards split alone (nothing to exchange), unless every call must be a group."""
    ranks = len(shards) // rows
    if ranks < 2:
        if not every_call or len(shards) < 2:
            return []
        ranks = len(shards)
    return [list(shards[i * ranks : (i + 1) * ranks]) for i in range(len(shards) // ranks)]


def first_failure(errors: Sequence[BaseException]) -> BaseException:
    """What a call that failed on several threads raises: a dead helper thread as `WorkerLost`
    (503: the lane restarts its helpers), else the first real error (not a rank that only saw
    another one fail)."""
    if any(not isinstance(e, Exception) and not isinstance(e, KeyboardInterrupt) for e in errors):
        lost = WorkerLost("a helper thread of this request's call died; it is being restarted: retry")
        return lost
    return next((e for e in errors if not isinstance(e, GroupBroken)), errors[0])
