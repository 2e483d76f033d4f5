"""Decode under CUDA graphs: capture a 4-layer step for a few batch sizes, replay with padding.

Run it as is: ``python examples/cuda_graph_decode.py``. On an sm90 GPU with FA3 installed it
captures and replays with the ``fa3`` backend and checks each replay against eager execution.
Without CUDA there is nothing to capture: it says so and runs the same steps eagerly on the
reference backend (exit status 0), so the script stays runnable everywhere.
"""

import torch

import attnsdk as A

PAGE, MAX_PAGES, NUM_LAYERS = 16, 32, 4
layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
layout = A.KVCacheLayout(num_kv_heads=2, head_dim=128, page_size=PAGE, dtype=torch.bfloat16)

use_graphs = torch.cuda.is_available() and not A.explain("fa3", layer, layout)["fa3"]
device = "cuda" if use_graphs else "cpu"
if not use_graphs:
    print("CUDA graphs need an sm90 GPU with FA3: running the steps eagerly on 'reference'.")
backend = A.create_backend("fa3" if use_graphs else "reference")
caches = [layout.allocate(num_pages=512, device=device) for _ in range(NUM_LAYERS)]


def step(plan: A.Plan, hidden: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A stand-in model step: every layer writes its K/V and attends; its output feeds the next."""
    for cache in caches:
        hidden = backend.forward(hidden, k, v, cache, plan, layer)
    return hidden


if use_graphs:
    runner = A.GraphRunner(
        backend, step, batch_sizes=[1, 4, 16], max_pages=MAX_PAGES, page_size=PAGE
    )
    x = torch.zeros(16, layer.num_heads, layer.head_dim, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(16, layer.num_kv_heads, layer.head_dim, dtype=torch.bfloat16, device=device)
    runner.capture(x, kv, kv)  # all-padding metadata: writes nothing to the caches

gen = torch.Generator().manual_seed(0)
seq_lens = [int(s) for s in torch.randint(1, 200, (11,), generator=gen)]
pages = torch.randperm(511, generator=gen)[: 11 * MAX_PAGES].view(11, MAX_PAGES) + 1
for batch in (1, 3, 11):  # replayed on the graphs captured for 1, 4 and 16
    lens = [s + 1 for s in seq_lens[:batch]]  # each sequence decodes one more token
    meta = A.AttentionMetadata.from_seqlens(
        [1] * batch, lens, pages[:batch].to(torch.int32), PAGE, device=device
    )
    q = torch.randn(batch, layer.num_heads, layer.head_dim, generator=gen).to(
        device, torch.bfloat16
    )
    k = torch.randn(batch, 2, layer.head_dim, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(batch, 2, layer.head_dim, generator=gen).to(device, torch.bfloat16)
    if use_graphs:
        out = runner(meta, q, k, v)
        # Eager on the same (already written) caches: k/v None, the graph wrote them.
        plan, ref = backend.plan(meta), q
        for cache in caches:
            ref = backend.forward(ref, None, None, cache, plan, layer)
        err = (out.float() - ref.float()).abs().max().item()
        size = next(b for b in runner.batch_sizes if b >= batch)
        print(
            f"batch {batch:2d}: replayed on the {size}-row graph, max |graph - eager| = {err:.2e}"
        )
    else:
        out = step(backend.plan(meta), q, k, v)
        print(f"batch {batch:2d}: eager step on {backend.name}, out {tuple(out.shape)}")
    seq_lens[:batch] = lens
