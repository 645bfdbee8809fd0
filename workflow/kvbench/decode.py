"""The one decode loop: greedy decoding of many rows at once, each through its own method cache.

A row is one prompt's continuation through one cache. Rows advance together, one forward pass per
step for every row still running: the projections, MLPs and LM head run batched (on a CPU a step of
one row costs about as much as a step of dozens: the weights are read once), while attention runs
row by row through each row's own cache (`MethodCache.attend`), so rows of different methods,
lengths and positions share a step and no method needs a batched implementation. One row alone is
plain greedy decoding with explicit positions (evicting caches are shorter than the sequence).

A row given a reference (the full cache's continuation) is teacher-forced on it: its distribution at
each position is compared with the reference's (KL, top-1 agreement). Up to the first position where
its greedy token differs, its own output and the reference are the same tokens; there a copy of its
cache branches off as a free row that continues on the method's own tokens (the row's task answer),
while the forced row goes on to the reference's end (its fidelity).

Timing, one definition for every stage and bench: a step's wall time (`step`: the forward pass and
the greedy pick) is shared equally by the rows it advanced; a row's TPOT is the sum of its shares
over the steps that produced its own tokens, divided by their count. With one row that is the
steps' wall time per token.
"""

from __future__ import annotations

import copy
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvbench.fidelity import Reference, position_fidelity
from kvbench.methods.attention import route_attention
from kvbench.methods.base import MethodCache


def eos_ids(model: torch.nn.Module) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [eos]) if eos is not None else frozenset()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _PassLayer(DynamicLayer):
    """Stands in for one layer of every row's cache inside the batched forward pass: the new K/V go
    through untouched to the attention route, which hands each row's slice to that row's cache."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the model's own mask is not used: each row gets its own below


class RowsCache(Cache):
    """The caches of a batch's rows, one per batch row; attention is routed per row."""

    def __init__(self, caches: list[MethodCache], layers: int) -> None:
        super().__init__(layers=[_PassLayer() for _ in range(layers)])
        self.caches = caches
        self.errors: dict[int, str] = {}  # batch row -> what its cache raised

    def attend(
        self,
        original: Callable,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ):
        index, n = module.layer_idx, query.shape[-2]
        outputs = []
        for b, cache in enumerate(self.caches):
            if b in self.errors:  # a row that failed earlier in this pass: zeros, dropped after it
                outputs.append(torch.zeros_like(query[b : b + 1].transpose(1, 2)))
                continue
            try:
                out, _ = cache.attend(
                    index,
                    original,
                    module,
                    query[b : b + 1],
                    key[b : b + 1],
                    value[b : b + 1],
                    causal_mask(n, cache, index, query),
                    **kwargs,
                )
            except Exception as err:  # one method failing on one row must not stop the others
                traceback.print_exc()
                self.errors[b] = f"{type(err).__name__}: {err}"
                out = torch.zeros_like(query[b : b + 1].transpose(1, 2))
            outputs.append(out)
        return torch.cat(outputs), None


def causal_mask(n: int, cache: MethodCache, index: int, query: torch.Tensor) -> torch.Tensor | None:
    """Additive mask for `n` new tokens over the keys the layer will hold after them: each new token
    sees every cached key and the new ones up to itself. None for one token (it sees everything)."""
    if n == 1:
        return None
    total = cache.layers[index].get_seq_length() + n
    later = torch.arange(total, device=query.device) > torch.arange(total - n, total, device=query.device)[:, None]
    return torch.zeros(n, total, dtype=query.dtype, device=query.device).masked_fill(later, float("-inf"))[None, None]


@contextmanager
def routed(model: torch.nn.Module, caches: list[MethodCache]) -> Iterator[RowsCache]:
    """The rows' caches as one cache for a forward pass of `model`, attention routed row by row;
    the routes are removed on exit."""
    rows = RowsCache(caches, model.config.num_hidden_layers)
    for cache in caches:
        cache.decoding(True)
    handles = route_attention(model, {i: rows.attend for i in range(model.config.num_hidden_layers)})
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()
        for cache in caches:
            cache.decoding(False)


def _last_logits(model: torch.nn.Module, rows: RowsCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, position_ids=positions, past_key_values=rows, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


@torch.inference_mode()
def forward_rows(
    model: torch.nn.Module, caches: list[MethodCache], ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, dict[int, str]]:
    """One forward pass of `ids` [B, n] at `positions` [B, n], row b through caches[b]: the last
    position's logits [B, V] (float32), and the rows whose cache raised (row -> error)."""
    with routed(model, caches) as rows:
        logits = _last_logits(model, rows, ids, positions)
    return logits, rows.errors


@dataclass(eq=False)
class Row:
    """One continuation through one cache. `logits`: the next-token distribution after what the cache
    holds (from the prefill); `position`: where the next token fed goes."""

    cache: MethodCache
    logits: torch.Tensor
    position: int
    max_new_tokens: int
    eos: frozenset[int] = frozenset()
    stop: Callable[[list[int]], bool] | None = None
    reference: Reference | None = None  # teacher-force on its tokens (compare with its log-probs)
    branch_free: bool = True  # a forced row spawns a free row at its first divergence
    forced_positions: int | None = None  # teacher-force at most this many positions (None: the reference's all)
    keep_logprobs: bool = False  # keep each position's log-softmax (what a reference run stores) ...
    keep_positions: int | None = None  # ... for at most this many positions
    tag: Any = None  # the caller's key for this row
    # filled in by the loop
    tokens: list[int] = field(default_factory=list)  # the method's own greedy output
    logprobs: list[torch.Tensor] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)  # per forced position
    top1: list[bool] = field(default_factory=list)
    divergence: int | None = None
    own_seconds: float = 0.0  # shares of the steps that produced own tokens
    own_done: bool = False  # own tokens complete (the forced part may go on)
    bytes_end: int | None = None
    branch: "Row | None" = None
    done: bool = False
    error: str | None = None  # what a step raised for this row (it stops there)
    _seconds: float = 0.0  # shares of every step this row took part in
    top: int | None = None  # argmax of `logits`, when the step computed it
    free: bool = False  # a forced row past its forced positions, still on its own (= the reference's) tokens

    def __post_init__(self) -> None:
        self.start = self.position  # the prompt's length: positions before it are the prompt

    def finished(self, tokens: list[int]) -> bool:
        return (
            tokens[-1] in self.eos
            or len(tokens) >= self.max_new_tokens
            or (self.stop is not None and self.stop(tokens))
        )

    @property
    def tpot_s(self) -> float | None:
        steps = len(self.tokens) - 1
        return self.own_seconds / steps if steps > 0 and self.own_done else None

    def result(self) -> "Row":
        """The row that holds the method's own output: the branch where one split off."""
        return self.branch.result() if self.branch is not None else self

    def advance(self, logprobs: torch.Tensor, top: int) -> tuple[int | None, "Row | None"]:
        """Take the distribution at the current position; return the token to feed next (None: this row
        is done) and a free row branched off here (or None)."""
        if self.keep_logprobs and (self.keep_positions is None or len(self.logprobs) < self.keep_positions):
            self.logprobs.append(logprobs)
        if self.reference is None or self.free:
            self.tokens.append(top)
            if self.finished(self.tokens):
                self._finish_own()
                self.done = True
                return None, None
            return top, None
        i = len(self.kl)
        ref = self.reference
        if ref.logprobs is not None:  # None: forced on tokens only (no distribution to compare with)
            kl, agree = position_fidelity(ref, i, logprobs)
            self.kl.append(kl)
            self.top1.append(agree)
        else:
            self.kl.append(float("nan"))
            self.top1.append(top == ref.tokens[i])
        spawned = None
        if not self.own_done:
            if top != ref.tokens[i]:
                self.divergence = i
                own = ref.tokens[:i] + [top]
                if self.finished(own) or not self.branch_free:
                    self.tokens = own
                    self._finish_own()
                else:  # a copy goes on with the method's own tokens
                    # it takes this same distribution first (appending `top`), then goes on by itself
                    spawned = Row(
                        copy.deepcopy(self.cache),
                        self.logits,
                        self.position,
                        self.max_new_tokens,
                        self.eos,
                        self.stop,
                        tag=self.tag,
                        tokens=ref.tokens[:i],
                        _seconds=self._seconds,
                        top=top,
                    )
                    self.branch = spawned
                    self.own_done = True  # the branch holds them
            elif i + 1 == len(ref.tokens):
                self.tokens = list(ref.tokens)
                self._finish_own()
        last = len(ref.tokens) if self.forced_positions is None else min(len(ref.tokens), self.forced_positions)
        if i + 1 < last:
            return ref.tokens[i], spawned
        if self.own_done or not self.branch_free:
            self.done = True
            return None, spawned
        # Every forced position agreed and the reference goes on: the row goes on by itself, on its
        # own tokens (the reference's so far), without a copy.
        self.free, self.tokens = True, ref.tokens[:i]
        return self.advance(logprobs, top)[0], spawned

    def _finish_own(self) -> None:
        self.own_done = True
        self.own_seconds = self._seconds
        self.bytes_end = self.cache.nbytes()


@dataclass
class Tally:
    """What decoding cost: batched steps, row-steps (a step of b rows counts b) and their wall time."""

    steps: int = 0
    row_steps: int = 0
    seconds: float = 0.0


@torch.inference_mode()
def step(
    model: torch.nn.Module, caches: list[MethodCache], tokens: list[int], positions: list[int]
) -> tuple[torch.Tensor, list[int], dict[int, str], float]:
    """One decode step: token b at position b through caches[b]. Returns the logits [B, V], the greedy
    picks, the rows whose cache raised and the step's wall time: the forward pass and the greedy pick,
    what every TPOT here is made of. The inputs and the attention routes are set up before the clock
    starts; inside the pass, attention still goes row by row through each row's cache."""
    device = next(model.parameters()).device
    ids = torch.tensor([[token] for token in tokens], device=device)
    at = torch.tensor([[position] for position in positions], device=device)
    with routed(model, caches) as rows:
        sync(device)
        start = time.perf_counter()
        logits = _last_logits(model, rows, ids, at)
        tops = logits.argmax(-1).tolist()
        sync(device)
        seconds = time.perf_counter() - start
    return logits, tops, rows.errors, seconds


def step_one(model: torch.nn.Module, cache: MethodCache, token: int, position: int) -> tuple[int, float]:
    """`step` for one cache (the benches' loop): (the greedy pick, the step's wall time); a cache
    that raised raises here, since a bench has no row to record it in."""
    _, tops, errors, seconds = step(model, [cache], [token], [position])
    if errors:
        raise RuntimeError(errors[0])
    return tops[0], seconds


def run_rows(model: torch.nn.Module, rows: Iterable[Row], max_batch: int = 64, tally: Tally | None = None) -> list[Row]:
    """Decode every row (and the rows they branch) to its end, at most `max_batch` rows per step.
    Each row starts from its `logits`; a spawned free row joins the next step."""
    pending = list(rows)
    every = list(pending)
    active: list[tuple[Row, int]] = []
    tally = tally if tally is not None else Tally()
    while pending or active:
        # rows take their distribution: a token to feed, or done
        for row in pending:
            top = int(row.logits.argmax()) if row.top is None else row.top
            token, spawned = row.advance(torch.log_softmax(row.logits, -1), top)
            if token is not None:
                active.append((row, token))
            if spawned is not None:
                every.append(spawned)
                token, more = spawned.advance(torch.log_softmax(spawned.logits, -1), top)
                assert more is None
                if token is not None:
                    active.append((spawned, token))
        pending = []
        if not active:
            break
        batch, active = active[:max_batch], active[max_batch:]
        logits, tops, errors, seconds = step(
            model, [row.cache for row, _ in batch], [token for _, token in batch], [row.position for row, _ in batch]
        )
        share = seconds / len(batch)
        tally.steps, tally.row_steps, tally.seconds = (
            tally.steps + 1,
            tally.row_steps + len(batch),
            tally.seconds + seconds,
        )
        for b, ((row, _), row_logits, top) in enumerate(zip(batch, logits, tops)):
            if b in errors:
                row.error, row.done = errors[b], True
                continue
            row.logits, row.top, row.position = row_logits, top, row.position + 1
            row._seconds += share
            pending.append(row)
    return every


def extend_rows(
    model: torch.nn.Module, caches: list[MethodCache], ids: list[int], position: int
) -> tuple[torch.Tensor, dict[int, str], float]:
    """Feed the same tokens `ids` at `position`.. through every cache in one batched pass (the
    context-only protocol's question after a compressed context); returns the last logits [B, V],
    the rows whose cache raised (row -> error) and the pass's wall time."""
    device = next(model.parameters()).device
    batch = torch.tensor([ids] * len(caches), device=device)
    positions = torch.arange(position, position + len(ids), device=device).expand(len(caches), -1)
    sync(device)
    start = time.perf_counter()
    logits, errors = forward_rows(model, caches, batch, positions)
    sync(device)
    return logits, errors, time.perf_counter() - start
