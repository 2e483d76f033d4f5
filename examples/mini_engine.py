"""A continuous-batching engine in a few hundred lines: a Hugging Face model keeps its own weights
and modules, and its attention runs through attnsdk over a paged KV cache that the engine owns.

Run it as is: ``python examples/mini_engine.py`` (a tiny random-weight Llama on the CPU, the
``reference`` backend; a few seconds). docs/guides/your_engine.md walks through the parts, in the
order they appear here:

1. ``PageAllocator``: a free list of cache pages; page 0 is kept for padding.
2. ``Request`` and ``Scheduler``: each step runs the decodes, then spends what is left of a token
   budget on prefills (chunked when a prompt does not fit) and admits new requests, so one step
   mixes prefills and decodes.
3. One ``AttentionMetadata`` and one ``backend.plan`` per step, shared by every layer.
4. ``attention``: the function registered with transformers. The model is called on the step's
   packed new tokens as one batch row, with each token's position in its own sequence; the
   function gets the step (plan and per-layer caches) as a keyword argument, and
   ``backend.forward`` writes the new K/V at their slots and attends over the cache.
5. ``MiniEngine``: shapes probed once, ``prepare`` + ``warmup``, greedy sampling, streaming,
   and decode steps replayed from CUDA graphs (``GraphRunner``) when the backend allows.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import attnsdk as A
from attnsdk.integrations.transformers import layer_spec

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

ATTN_IMPL = "mini_engine"
"""The name the engine registers its attention function under in transformers."""


# -- 1. pages ----------------------------------------------------------------------------------


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PageAllocator:
    """Hands out cache pages 1..N-1. Page 0 is never handed out: padding entries of the page
    table point at it (DESIGN §2: padding reads the reserved page and writes nothing)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low page ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


# -- 2. requests and the scheduler --------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Request:
    """One generation request; the engine fills ``output`` and the bookkeeping fields."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    """Cache pages, in logical order: token j of the sequence is at ``pages[j // P]``."""
    num_cached: int = 0
    """Tokens whose K/V are in the cache. The tokens after it are this step's input: a prompt
    (chunk) in prefill, the last sampled token in decode."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt)

    @property
    def done(self) -> bool:
        stopped = bool(self.output) and self.output[-1] == self.eos_token_id
        return stopped or len(self.output) >= self.max_new_tokens

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids ``start:stop`` of prompt + output."""
        p = len(self.prompt)
        return self.prompt[start:stop] + self.output[max(start - p, 0) : max(stop - p, 0)]


class Scheduler:
    """Picks each step's (request, new tokens) pairs: decodes first, then prefills.

    A request gets the pages of its prompt plus ``max_new_tokens`` when it is admitted, so a
    running request never waits for memory (real engines allocate as sequences grow and
    preempt when the pool runs dry; that is engine policy, not attention).
    """

    def __init__(
        self, allocator: PageAllocator, page_size: int, max_batch: int, token_budget: int
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> list[tuple[Request, int]]:
        batch: list[tuple[Request, int]] = []
        budget = self.token_budget
        # Decodes (in_prefill False) first: a token each keeps their latency flat while a long
        # prompt is prefilled in chunks next to them.
        for req in sorted(self.running, key=lambda r: r.in_prefill):
            if len(batch) == self.max_batch or budget == 0:
                break
            n = min(req.num_tokens - req.num_cached, budget)
            batch.append((req, n))
            budget -= n
        while self.waiting and budget and len(batch) < self.max_batch:
            req = self.waiting[0]
            need = pages_for(len(req.prompt) + req.max_new_tokens, self.page_size)
            if need > self.allocator.num_free:
                break  # first come, first served: wait for pages to be freed
            self.waiting.popleft()
            req.pages = self.allocator.allocate(need)
            self.running.append(req)
            n = min(len(req.prompt), budget)
            batch.append((req, n))
            budget -= n
        return batch

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.release(req.pages)
        req.pages = []


# -- 3 and 4. attention through attnsdk ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """What the attention function needs for one model call, passed as the keyword argument
    ``attnsdk_step`` (transformers forwards unknown keyword arguments to the attention function,
    so the engine holds no global per-step state)."""

    backend: A.Backend
    plan: A.Plan | None
    """The step's plan; None on the shape probe (records ``layers``, attends nothing)."""
    caches: Sequence[A.KVCache]
    """One cache per layer, indexed by ``module.layer_idx``."""
    layers: dict[int, A.LayerSpec] = field(default_factory=dict)


def _refuse(field_name: str, message: str) -> A.UnsupportedConfigError:
    return A.UnsupportedConfigError(
        "the mini engine cannot serve this attention call:",
        [A.Reason(A.ReasonKind.CONFIGURATION, field_name, message)],
    )


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    attnsdk_step: Step | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Called by every attention layer with post-RoPE ``query`` (1, Hq, T, D) and the new tokens'
    ``key`` / ``value`` (1, Hkv, T, D|Dv); returns (1, T, Hq, Dv) as transformers expects."""
    if attnsdk_step is None:
        raise _refuse("attnsdk_step", "is missing: call the model through MiniEngine")
    if query.shape[0] != 1:
        raise _refuse("query", f"must be one packed batch row, found B={query.shape[0]}")
    if attention_mask is not None:
        raise _refuse("attention_mask", "must be None (masking comes from the metadata)")
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise _refuse("layer_idx", f"must be the module's layer index, found {layer_idx!r}")
    # Causality, window, softcap, sinks and chunks as the integration maps them.
    layer = layer_spec(module, query, key, value, scaling, dropout, **kwargs)
    sinks = kwargs.get("s_aux")
    if attnsdk_step.plan is None:  # the shape probe
        attnsdk_step.layers[layer_idx] = layer
        return query.new_zeros(1, query.shape[2], layer.num_heads, layer.v_dim), None
    if not 0 <= layer_idx < len(attnsdk_step.caches):
        raise _refuse("layer_idx", f"must index one of {len(attnsdk_step.caches)} caches")
    out = attnsdk_step.backend.forward(
        query[0].transpose(0, 1).contiguous(),  # (T, Hq, D)
        key[0].transpose(0, 1).contiguous(),  # (T, Hkv, D): written at the plan's slots
        value[0].transpose(0, 1).contiguous(),
        attnsdk_step.caches[layer_idx],
        attnsdk_step.plan,
        layer,
        sinks=None if sinks is None else sinks.detach().float(),
    )
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Register ``attention`` under ``ATTN_IMPL``, and no mask function: for a name without one,
    transformers builds no mask (causality, windows and sequence boundaries come from the
    metadata) and skips its packed-sequence detection, which reads the positions back to the host
    (a device sync every step)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, attention)


# -- 5. the engine -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepResult:
    num_prefill: int
    """Sequences that fed prompt tokens this step (a whole prompt or a chunk)."""
    num_decode: int
    num_tokens: int
    graph: bool
    """Replayed from a CUDA graph."""
    emitted: list[tuple[Request, int]]
    """(request, new token) for every request that sampled one this step."""


class MiniEngine:
    """Serves a Hugging Face causal LM (``use_cache=False``: attnsdk owns the KV cache)."""

    def __init__(
        self,
        model: Any,
        backend: A.Backend,
        *,
        num_pages: int = 256,
        page_size: int = 16,
        max_batch: int = 16,
        token_budget: int = 256,
        max_model_len: int = 1024,
        use_graphs: bool | None = None,
    ) -> None:
        register_attention()
        model.set_attn_implementation(ATTN_IMPL)
        self.model = model.eval()
        self.backend = backend
        self.device = next(model.parameters()).device
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.layers = self._probe_layers(model.config.num_hidden_layers)
        if len({(s.num_kv_heads, s.head_dim, s.v_dim) for s in self.layers}) != 1:
            raise _refuse("layers", "must share one KV shape (this engine keeps one layout)")
        first = self.layers[0]
        self.layout = A.KVCacheLayout(
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            v_head_dim=first.v_head_dim,
            page_size=page_size,
            dtype=model.dtype,
        )
        backend.prepare(self.layers, self.layout, self.device)  # every reason, before serving
        backend.warmup(self.device)
        self.caches = [self.layout.allocate(num_pages, self.device) for _ in self.layers]
        self.allocator = PageAllocator(num_pages)
        self.scheduler = Scheduler(self.allocator, page_size, max_batch, token_budget)
        if use_graphs is None:
            use_graphs = (
                self.device.type == "cuda"
                and backend.capabilities.graph_support >= A.GraphSupport.DECODE_ONLY
            )
        self.graphs = self._capture_decode(max_batch) if use_graphs else None

    def _probe_layers(self, num_layers: int) -> list[A.LayerSpec]:
        """Each layer's LayerSpec, read from one 1-token forward that attends nothing."""
        probe = Step(self.backend, None, caches=())
        with torch.inference_mode():
            self.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                use_cache=False,
                attnsdk_step=probe,
            )
        if sorted(probe.layers) != list(range(num_layers)):
            raise _refuse("layers", f"expected attention in layers 0..{num_layers - 1}")
        return [probe.layers[i] for i in range(num_layers)]

    def _forward(
        self, plan: A.Plan, ids: torch.Tensor, positions: torch.Tensor, keep: Any = 0
    ) -> torch.Tensor:
        """Logits (rows, vocab) of the packed step; ``keep``: the rows to project (0: all)."""
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],  # RoPE rotates each token at its own position
            use_cache=False,
            logits_to_keep=keep,
            attnsdk_step=Step(self.backend, plan, self.caches),
        )
        return out.logits[0]

    def _capture_decode(self, max_batch: int) -> A.GraphRunner:
        # Untested on a GPU so far (no GPU where this was written); the CPU path never gets here.
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
        runner = A.GraphRunner(
            self.backend,
            self._forward,
            batch_sizes=sizes,
            max_pages=pages_for(self.max_model_len, self.page_size),
            page_size=self.page_size,
            device=self.device,
        )
        rows = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            runner.capture(rows, rows)  # all-padding metadata: writes nothing to the caches
        return runner

    def submit(self, req: Request) -> None:
        total = len(req.prompt) + req.max_new_tokens
        if not req.prompt or req.max_new_tokens < 1:
            raise ValueError(f"request {req.rid}: needs a prompt and max_new_tokens >= 1")
        if total > self.max_model_len:
            raise ValueError(f"request {req.rid}: {total} tokens > max_model_len")
        if pages_for(total, self.page_size) > self.allocator.num_pages - 1:
            raise ValueError(f"request {req.rid}: needs more pages than the cache has")
        self.scheduler.add(req)

    def step(self) -> StepResult | None:
        batch = self.scheduler.schedule()
        if not batch:
            return None
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, sample_rows, samplers = [], [], [], []
        for req, n in batch:
            start = req.num_cached
            ids += req.tokens(start, start + n)
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == req.num_tokens:  # its last input token: sample the next one
                sample_rows.append(len(ids) - 1)
                samplers.append(req)
        width = max(pages_for(s, self.page_size) for s in seq_lens)
        page_table = [(req.pages + [0] * width)[:width] for req, _ in batch]
        meta = A.AttentionMetadata.from_seqlens(
            query_lens, seq_lens, page_table, self.page_size, device=self.device
        )
        ids_t = torch.tensor(ids, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        runner = self.graphs
        if runner is not None and (meta.max_query_len > 1 or len(batch) > runner.batch_sizes[-1]):
            runner = None  # prefills and oversized batches run eagerly
        with torch.inference_mode():
            if runner is not None:
                logits = runner(meta, ids_t, pos_t)  # a decode row per sequence
            else:
                rows = torch.tensor(sample_rows, device=self.device)
                logits = self._forward(self.backend.plan(meta), ids_t, pos_t, keep=rows)
                sample_rows = list(range(len(sample_rows)))
            tokens = logits[sample_rows].argmax(-1).tolist()  # greedy; the step's one sync
        num_prefill = sum(req.in_prefill for req, _ in batch)
        for req, n in batch:
            req.num_cached += n
        for req, token in zip(samplers, tokens):
            req.output.append(token)
            if req.done:
                self.scheduler.finish(req)
        return StepResult(
            num_prefill,
            len(batch) - num_prefill,
            len(ids),
            runner is not None,
            list(zip(samplers, tokens)),
        )

    def run(
        self, arrivals: Mapping[int, Sequence[Request]], *, verbose: bool = False
    ) -> list[StepResult]:
        """Submit ``arrivals[i]`` before step i; step until every request is done."""
        results: list[StepResult] = []
        pending = dict(arrivals)
        start = time.perf_counter()
        while pending or self.scheduler.has_work:
            for req in pending.pop(len(results), ()):
                self.submit(req)
            result = self.step()
            if result is None:  # nothing runnable yet: the next arrivals come later
                result = StepResult(0, 0, 0, False, [])
            results.append(result)
            if verbose and result.num_tokens:
                stream = "  ".join(f"r{req.rid}:{tok}" for req, tok in result.emitted)
                print(
                    f"step {len(results):3d} | {result.num_prefill} prefill + "
                    f"{result.num_decode} decode, {result.num_tokens:3d} tokens"
                    f"{' (graph)' if result.graph else ''} | free pages "
                    f"{self.allocator.num_free}/{self.allocator.num_pages - 1} | {stream}"
                )
        if verbose:
            total = sum(len(r.emitted) for r in results)
            seconds = time.perf_counter() - start
            print(f"{total} tokens in {len(results)} steps, {seconds:.2f} s")
        return results


def main() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        eos_token_id=None,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # GPU kernels: 16-bit
    model = AutoModelForCausalLM.from_config(config).to(device, dtype)
    backend = A.create_backend(None, device=device)  # the environment's choice, else "auto"
    engine = MiniEngine(model, backend, num_pages=64, page_size=4, max_batch=8, token_budget=24)
    print(
        f"backend {backend.name} on {device}: {len(engine.layers)} layers, "
        f"{len(engine.caches[0].k)} pages of {engine.page_size} tokens per layer"
    )

    prompts = [torch.randint(1, 256, (n,)).tolist() for n in (5, 30, 9, 14)]
    requests = [Request(i, p, max_new_tokens=8) for i, p in enumerate(prompts)]
    # Two arrive at once, two while the first ones decode; the 30-token prompt is prefilled
    # in two chunks (token budget 24).
    engine.run({0: requests[:2], 3: requests[2:3], 5: requests[3:]}, verbose=True)
    for req in requests:
        print(f"request {req.rid} ({len(req.prompt)} prompt tokens): {req.output}")


if __name__ == "__main__":
    main()
