"""DDP with two processes (gloo, CPU) steps exactly as one process on the same global batch.

Rank 0 trains on batch A, rank 1 on batch B; one process trains on A and B packed together
(separate samples: their own doc ids and positions). After three optimizer steps the weights
agree to float rounding: the per-step loss denominators are global, DDP averages gradients.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3_pipeline.train.data import PackedBatch
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter
from eagle3_pipeline.train.step import StepRunner, leave_process_group

VOCAB, HIDDEN, STEPS, TTT = 40, 16, 3, 3
LR = 0.5  # with grad_clip=0.5: each step moves the weights by a gradient of norm 0.25 at most


def make_model() -> Eagle3Drafter:
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           intermediate_size=32, target_hidden_size=HIDDEN, num_aux_hidden_states=3,
                           vocab_size=VOCAB, draft_vocab_size=30)
    model = Eagle3Drafter(config)
    model.load_target_embeddings(torch.randn(VOCAB, HIDDEN))
    return model


def make_batch(seed: int, lengths: list[int]) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return PackedBatch(
        input_ids=torch.randint(0, VOCAB, (total,), generator=gen),
        loss_mask=torch.rand(total, generator=gen) > 0.2,
        aux_hidden=torch.randn(total, 3 * HIDDEN, generator=gen),
        last_hidden=torch.randn(total, HIDDEN, generator=gen),
        doc_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
    )


def concat(a: PackedBatch, b: PackedBatch) -> PackedBatch:
    return PackedBatch(*(torch.cat([getattr(a, n), getattr(b, n) + (a.doc_ids.max() + 1 if n == "doc_ids" else 0)])
                         for n in ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "doc_ids",
                                   "position_ids")))


LM_HEAD = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5)) * 4
BATCHES = [(make_batch(10 + s, [9, 14]), make_batch(20 + s, [17, 6, 5])) for s in range(STEPS)]


def train(model: Eagle3Drafter, batches: list) -> dict[str, torch.Tensor]:
    runner = StepRunner(model, LM_HEAD, ttt_length=TTT, device=torch.device("cpu"), dtype="float32",
                        parallel="ddp")
    # SGD, not AdamW: an SGD step is linear in the gradient, so the two runs part only by the float32
    # rounding of their gradient sums (relative ~1e-6 of each update) and of the updates themselves (half
    # an ulp of each weight per step). Adam divides a gradient by its own running size, which turns the
    # rounding noise of a near-zero gradient (a cancelling sum: the ranks' halves pull opposite ways)
    # into an update of any size up to lr, so no tolerance short of lr itself holds for it on every CPU.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for batch in batches:
        runner.train_step(batch, optimizer, LR, grad_clip=0.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        state = train(make_model(), [pair[rank] for pair in BATCHES])
        if rank == 0:
            from safetensors.torch import save_file  # noqa: PLC0415

            save_file(state, out)
    finally:
        leave_process_group()


def test_two_processes_step_as_one_on_the_global_batch(tmp_path):
    from safetensors.torch import load_file  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "ddp.safetensors"
    mp.spawn(worker, args=(port, str(out)), nprocs=2, join=True)
    ddp = load_file(str(out))
    single = train(make_model(), [concat(a, b) for a, b in BATCHES])
    # One process accumulating the two batches of each step: the same step again (a global batch that does not
    # depend on the number of processes).
    accumulated = train(make_model(), [[a, b] for a, b in BATCHES])
    initial = make_model().state_dict()
    for name, value in single.items():
        assert torch.allclose(ddp[name], value, atol=2e-6, rtol=1e-5), name
        assert torch.allclose(accumulated[name], value, atol=2e-6, rtol=1e-5), name
    moved = [n for n in single if not torch.equal(single[n], initial[n])]
    assert "fc.weight" in moved and "lm_head.weight" in moved  # the check compares trained weights
