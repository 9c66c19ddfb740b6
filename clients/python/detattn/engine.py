"""A continuous-batching engine: requests join and leave between steps; each step packs the
prefill chunks and decode tokens of every running request into one model step, so every
layer is one attention call (one Forward through detattnd) for the whole batch.

Sampling is greedy, or seeded per request (temperature, a torch.Generator of its own), so a
request's tokens depend only on its logits. Parallel sampling forks a request's sequence
after its prompt (copy-on-write in detattnd); speculative rollback truncates it. The model
may sit on a GPU: each step's logits come to the host once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from .model import Transformer
from .torch import AttentionBackend, SequenceTable


@dataclass(eq=False)
class Request:
    prompt: List[int]
    max_new: int
    temperature: float = 0.0   # 0: greedy
    seed: int = 0
    prefill_chunk: int = 0     # 0: the engine's
    id: int = field(default_factory=itertools.count().__next__)
    # state
    done_prompt: int = 0
    out: List[int] = field(default_factory=list)
    pending: Optional[int] = None  # the last sampled token, not yet fed
    finished: bool = False
    gen: Optional[torch.Generator] = None
    # When set (a hashlib object): fed the bits of every logits row sampled from, so two
    # runs can be compared below the level of tokens.
    trace: Any = None

    @property
    def length(self) -> int:
        """Tokens in the request's sequence (fed to the model so far)."""
        return self.done_prompt + len(self.out) - (1 if self.pending is not None else 0)


class Engine:
    """Runs requests on ``model`` with attention from ``attn``. ``max_batch_tokens`` bounds the
    tokens of one step; ``prefill_chunk`` the tokens of one request's prefill per step. With
    ``whole_chunks`` a prefill chunk is never cut short to fit the step's remaining budget:
    it waits for a step with room (unless it could never fit). The engine's ``table`` keeps
    each request's sequence and length."""

    def __init__(self, model: Transformer, attn: AttentionBackend, max_batch_tokens: int = 512,
                 prefill_chunk: int = 128, whole_chunks: bool = False):
        self.model, self.attn = model, attn
        self.table = SequenceTable(attn)
        self.max_batch_tokens, self.prefill_chunk = max_batch_tokens, prefill_chunk
        self.whole_chunks = whole_chunks
        self.running: List[Request] = []
        self.steps = 0
        self.tokens = 0
        self.decode_tokens = 0

    def add(self, r: Request) -> Request:
        """The request joins: its sequence opens; it runs from the next step."""
        self.table.open(r.id)
        if r.temperature > 0:
            r.gen = torch.Generator().manual_seed(r.seed)
        self.running.append(r)
        return r

    def fork(self, r: Request, seed: Optional[int] = None) -> Request:
        """A new request continuing from r's tokens so far (shares its KV pages): parallel
        sampling with its own seed, or (seed None) r's sampler state, giving r's tokens."""
        f = Request(prompt=list(r.prompt), max_new=r.max_new, temperature=r.temperature,
                    seed=r.seed if seed is None else seed, prefill_chunk=r.prefill_chunk)
        self.table.fork(r.id, f.id)
        f.done_prompt, f.out, f.pending = r.done_prompt, list(r.out), r.pending
        if f.temperature > 0:
            f.gen = torch.Generator()
            if seed is None:
                f.gen.set_state(r.gen.get_state())
            else:
                f.gen.manual_seed(seed)
        self.running.append(f)
        return f

    def rollback(self, r: Request, n_out: int) -> None:
        """Speculative rollback: keeps the first n_out generated tokens (the next one is fed
        again at the next step)."""
        n_out = max(1, min(n_out, len(r.out)))
        keep = r.done_prompt + n_out - 1
        self.table.truncate(r.id, keep)
        r.out = r.out[:n_out]
        r.pending = r.out[-1]
        r.finished = False

    def _sample(self, r: Request, logits: torch.Tensor) -> int:
        if r.temperature <= 0:
            return int(torch.argmax(logits))
        p = torch.softmax(logits / r.temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=r.gen))

    def step(self) -> List[Request]:
        """One model step over the running requests; returns the requests that finished."""
        tokens, counts, owners = [], [], []
        budget = self.max_batch_tokens
        for r in self.running:
            if r.finished or budget <= 0:
                continue
            if r.done_prompt < len(r.prompt):
                chunk = r.prefill_chunk or self.prefill_chunk or len(r.prompt)
                want = min(chunk, len(r.prompt) - r.done_prompt)
                if self.whole_chunks and want > budget and budget < self.max_batch_tokens:
                    continue
                n = min(want, budget)
                toks = r.prompt[r.done_prompt:r.done_prompt + n]
            elif r.pending is not None:
                n, toks = 1, [r.pending]
            else:
                continue
            assert self.table.length(r.id) == r.length, (r.id, self.table.length(r.id), r.length)
            counts.append((r.id, n))
            owners.append((r, n))
            tokens += toks
            budget -= n
        if not counts:
            return []
        batch = self.table.batch(counts)
        logits = self.model.step(torch.tensor(tokens), batch).cpu()
        self.table.commit(batch)
        self.steps += 1
        self.tokens += len(tokens)
        self.decode_tokens += sum(1 for r, n in owners if n == 1 and r.done_prompt >= len(r.prompt))
        finished = []
        for (r, n), lg in zip(owners, logits):
            if r.done_prompt < len(r.prompt):
                r.done_prompt += n
                if r.done_prompt < len(r.prompt):
                    continue
            else:
                r.pending = None
            if r.trace is not None:
                r.trace.update(lg.numpy().tobytes())
            t = self._sample(r, lg)
            r.out.append(t)
            r.pending = t
            if len(r.out) >= r.max_new:
                r.finished = True
                finished.append(r)
        return finished

    def release(self, r: Request) -> None:
        """The request leaves: its sequence closes (its pages go back to the daemon)."""
        if r in self.running:
            self.running.remove(r)
        if r.id in self.table:
            self.table.close(r.id)

    def run(self, requests: List[Request]) -> List[Request]:
        """Runs requests to completion (all joining now)."""
        for r in requests:
            self.add(r)
        while any(not r.finished for r in requests):
            for r in self.step():
                self.release(r)
        return requests


def generate(model: Transformer, attn: AttentionBackend, prompt: List[int], max_new: int,
             temperature: float = 0.0, seed: int = 0, prefill_chunk: int = 0) -> List[int]:
    """One request alone."""
    eng = Engine(model, attn, prefill_chunk=prefill_chunk or 128)
    (r,) = eng.run([Request(list(prompt), max_new, temperature, seed, prefill_chunk)])
    return r.out
