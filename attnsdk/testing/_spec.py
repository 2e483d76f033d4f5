"""``BatchSpec``: the lengths of a test batch, with named presets for the shapes engines produce."""

from __future__ import annotations

import random
from dataclasses import dataclass

from attnsdk.contract.errors import InvalidMetadataError

__all__ = ["BatchSpec"]


@dataclass(frozen=True, slots=True)
class BatchSpec:
    """Query and KV lengths of each sequence of a batch (see DESIGN §2 for their meaning).

    ``padded[b]`` marks a CUDA-graph padding row: its page-table row points at the reserved
    page 0 and its tokens write nothing. Zero-length rows (query_len 0) need no flag.
    ``cross``: a cross-attention step (``AttentionMetadata.cross_attention``): ``seq_lens`` are
    the encoder's lengths, which a sequence's queries may outnumber.

    >>> spec = BatchSpec.mixed(seed=1)
    >>> spec.num_seqs == len(spec.query_lens) and spec.num_tokens == sum(spec.query_lens)
    True
    """

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    name: str = "custom"
    padded: tuple[bool, ...] = ()
    cross: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "query_lens", tuple(int(x) for x in self.query_lens))
        object.__setattr__(self, "seq_lens", tuple(int(x) for x in self.seq_lens))
        if len(self.query_lens) != len(self.seq_lens):
            raise InvalidMetadataError(
                "query_lens", f"{len(self.seq_lens)} entries like seq_lens", len(self.query_lens)
            )
        for b, (q, s) in enumerate(zip(self.query_lens, self.seq_lens)):
            if q < 0:
                raise InvalidMetadataError(f"query_lens[{b}]", ">= 0", q)
            if s < q and not self.cross:
                raise InvalidMetadataError(f"seq_lens[{b}]", f">= query_lens[{b}]={q}", s)
        padded = tuple(bool(p) for p in self.padded) or (False,) * len(self.seq_lens)
        if len(padded) != len(self.seq_lens):
            raise InvalidMetadataError("padded", f"{len(self.seq_lens)} flags or none", len(padded))
        object.__setattr__(self, "padded", padded)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Cached tokens of each sequence before this step."""
        return tuple(s - q for q, s in zip(self.query_lens, self.seq_lens))

    def with_padding(self, rows: int = 2, query_len: int = 1) -> BatchSpec:
        """This batch plus ``rows`` CUDA-graph padding rows (``query_len`` tokens, seq_len = that)."""
        return BatchSpec(
            self.query_lens + (query_len,) * rows,
            self.seq_lens + (max(query_len, 1),) * rows,
            f"{self.name}+padding",
            self.padded + (True,) * rows,
            self.cross,
        )

    # Presets: the batch shapes serving engines produce. ``seed`` varies the lengths.

    @classmethod
    def decode(cls, batch_size: int = 8, max_context: int = 200, seed: int = 0) -> BatchSpec:
        """One new token per sequence on top of a cached context."""
        r = random.Random(seed)
        seqs = [r.randint(1, max_context) + 1 for _ in range(batch_size)]
        return cls((1,) * batch_size, tuple(seqs), "decode")

    @classmethod
    def prefill(cls, batch_size: int = 4, max_len: int = 100, seed: int = 0) -> BatchSpec:
        """Whole prompts, no cached context."""
        r = random.Random(seed)
        q = [r.randint(1, max_len) for _ in range(batch_size)]
        return cls(tuple(q), tuple(q), "prefill")

    @classmethod
    def chunked_prefill(
        cls, batch_size: int = 4, max_chunk: int = 48, max_context: int = 150, seed: int = 0
    ) -> BatchSpec:
        """Extend: a chunk of new tokens on top of a cached prefix."""
        r = random.Random(seed)
        q = [r.randint(2, max_chunk) for _ in range(batch_size)]
        s = [qi + r.randint(1, max_context) for qi in q]
        return cls(tuple(q), tuple(s), "chunked_prefill")

    @classmethod
    def mixed(cls, batch_size: int = 8, max_len: int = 120, seed: int = 0) -> BatchSpec:
        """Decode, extend and prefill rows in one batch, in random order."""
        r = random.Random(seed)
        q, s = [], []
        for b in range(batch_size):
            kind = (b + seed) % 3
            ctx = 0 if kind == 2 else r.randint(1, max_len)
            qi = 1 if kind == 0 else r.randint(2, max_len // 2)
            q.append(qi)
            s.append(ctx + qi)
        order = list(range(batch_size))
        r.shuffle(order)
        return cls(tuple(q[i] for i in order), tuple(s[i] for i in order), "mixed")

    @classmethod
    def verify(
        cls, batch_size: int = 4, draft_tokens: int = 4, max_context: int = 150, seed: int = 0
    ) -> BatchSpec:
        """Speculative verify: several query tokens per sequence after a context (causal chain)."""
        r = random.Random(seed)
        s = [draft_tokens + r.randint(1, max_context) for _ in range(batch_size)]
        return cls((draft_tokens,) * batch_size, tuple(s), "verify")

    @classmethod
    def cross_attention(
        cls, batch_size: int = 5, max_query: int = 40, max_encoder: int = 60, seed: int = 0
    ) -> BatchSpec:
        """Cross-attention: decoder tokens over an encoder's keys. Every third row decodes one
        token; every fourth has a short encoder (1..8 keys, often fewer than its queries); the
        fifth has none (its queries see no key)."""
        r = random.Random(seed)
        q = [1 if b % 3 == 0 else r.randint(2, max_query) for b in range(batch_size)]
        s = [r.randint(1, max_encoder) if b % 4 else r.randint(1, 8) for b in range(batch_size)]
        if batch_size > 4:
            s[4] = 0
        return cls(tuple(q), tuple(s), "cross_attention", cross=True)

    @classmethod
    def long_context(cls, batch_size: int = 2, context: int = 4096, seed: int = 0) -> BatchSpec:
        """Decode and a short extend over long contexts."""
        r = random.Random(seed)
        q = [1 if b % 2 == 0 else r.randint(2, 16) for b in range(batch_size)]
        s = [context - r.randint(0, context // 8) for _ in range(batch_size)]
        return cls(tuple(q), tuple(max(si, qi) for qi, si in zip(q, s)), "long_context")

    @classmethod
    def with_empty_rows(cls, seed: int = 0) -> BatchSpec:
        """A mixed batch with zero-length rows (query_len 0, and seq_len 0 or a context)."""
        base = cls.mixed(batch_size=4, seed=seed)
        return cls(
            (0, *base.query_lens[:2], 0, *base.query_lens[2:], 0),
            (0, *base.seq_lens[:2], 7, *base.seq_lens[2:], 0),
            "empty_rows",
        )

    @classmethod
    def chunk_edges(cls, chunk_size: int = 32, seed: int = 0) -> BatchSpec:
        """Rows on the edges of chunked local attention's chunks of ``chunk_size`` tokens:
        decode rows on the first and on the last position of a chunk, an extend across a
        boundary, an extend starting on one, a prefill over several chunks and a row without
        queries, in random order.

        >>> spec = BatchSpec.chunk_edges(16, seed=1)
        >>> sorted(s % 16 for q, s in zip(spec.query_lens, spec.seq_lens) if q == 1)
        [0, 1]
        """
        r = random.Random(seed)
        c = chunk_size
        cross = r.randint(2, max(2, c))
        after = r.randint(2, 2 * c)
        prefill = r.randint(2 * c + 1, 4 * c)
        rows = [  # (query_len, seq_len)
            (1, r.randint(1, 3) * c + 1),  # the first position of a chunk: sees only itself
            (1, r.randint(1, 3) * c),  # the last position: sees its whole chunk
            (cross, r.randint(1, 2) * c + r.randint(1, cross - 1)),
            (after, r.randint(1, 2) * c + after),  # its context ends on a boundary
            (prefill, prefill),
            (0, r.randint(1, 3 * c)),
        ]
        r.shuffle(rows)
        return cls(tuple(q for q, _ in rows), tuple(s for _, s in rows), "chunk_edges")

    @classmethod
    def random(
        cls,
        seed: int | random.Random = 0,
        *,
        max_batch: int = 7,
        max_context: int = 300,
        max_query: int = 70,
    ) -> BatchSpec:
        """1 to ``max_batch`` rows of random kinds in random order: decodes (twice as likely),
        extends and prefills of up to ``max_query`` tokens, empty rows with and without a
        context of up to ``max_context`` tokens; never all empty. ``seed`` may be a
        ``random.Random`` to draw several batches from one stream."""
        r = seed if isinstance(seed, random.Random) else random.Random(seed)
        q, s = [], []
        for _ in range(r.randint(1, max_batch)):
            kind = r.choice(["decode", "decode", "extend", "prefill", "empty", "empty_ctx"])
            ctx = {"prefill": 0, "empty": 0}.get(kind, r.randint(1, max_context))
            qi = {"decode": 1, "empty": 0, "empty_ctx": 0}.get(kind) or r.randint(2, max_query)
            q.append(qi)
            s.append(ctx + qi)
        if sum(q) == 0:
            q[0], s[0] = 1, s[0] + 1
        return cls(tuple(q), tuple(s), "random")

    @classmethod
    def presets(cls, seed: int = 0) -> dict[str, BatchSpec]:
        """Every named preset at its default size."""
        return {
            s.name: s
            for s in (
                cls.decode(seed=seed),
                cls.prefill(seed=seed),
                cls.chunked_prefill(seed=seed),
                cls.mixed(seed=seed),
                cls.verify(seed=seed),
                cls.long_context(context=1024, seed=seed),
                cls.with_empty_rows(seed=seed),
                cls.decode(batch_size=4, seed=seed).with_padding(),
            )
        }
