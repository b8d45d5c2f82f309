"""Benchmark: the drafter's training step (``StepRunner.train_step``) against SpecForge 0.2.0's, side by side.

One process, one GPU, the same shape and the same kind of data for every implementation:

- shape: a Llama-3.1-8B-shaped EAGLE-3 drafter (hidden 4096, MLP 14336, 32 heads, 8 KV heads,
  head_dim 128, target vocabulary 128256, draft vocabulary 32000, 3 aux layers -> fc 12288 -> 4096),
  TTT length 7, RoPE theta 500000 (no scaling: it only changes the frequencies' values), random weights;
- data: random, one 2048-token sample per step (``--docs`` packs several samples into the 2048 tokens),
  every token a loss token, the batches in pinned host memory (as a data loader would hand them over);
  the teacher is computed in the step from the target's last hidden states and its lm_head (bf16);
- ``ours``: the exact code the trainer runs: ``Eagle3Drafter`` built in fp32, ``model.to(device)``,
  ``torch.optim.AdamW`` over the trainable parameters, ``StepRunner(..., dtype="bfloat16")`` and
  ``train_step(batch, optimizer, lr, grad_clip=0.5)`` (fp32 master weights, bf16 compute);
- ``specforge-flex`` / ``specforge-sdpa``: SpecForge 0.2.0's own step (``Eagle3TrainStrategy.forward_loss``
  over ``OnlineEagle3Model`` with a ``LlamaForCausalLMEagle3`` draft in bf16, compact teacher from the
  hidden states, ``loss.backward()``, ``BF16Optimizer.step()``: fp32 masters, grad clip 0.5), what its
  trainer's ``TrainerCore.train_step`` does for one micro-batch. Imported from ``--specforge-path``
  (``pip install --no-deps --target /tmp/sf specforge-0.2.0-py3-none-any.whl``); when it cannot be
  imported the benchmark says so and measures ours alone.

Per implementation: ``--warmup`` steps (the first includes torch.compile's compilation; their total is
printed as the warm-up time), then ``--steps`` timed steps between two device synchronisations. Printed:
tokens/s, MFU, peak memory since the model was built (``max_memory_allocated`` and ``_reserved``; the
caching allocator is emptied and the peaks reset between implementations), and the ratios ours/SpecForge.

MFU = tokens/s x FLOPs per token / 989.4e12 (H100 and H200 SXM dense BF16 peak), FLOPs per token =
3 x 2 x (TTT x (midlayer + lm_head parameters) + fc parameters)   forward + backward of what trains
+ 2 x H x (draft vocab + full vocab)                               the teacher's two lm_head products
(attention's own FLOPs are not counted, nor any recomputation).

``--tiny`` runs ours on the CPU with a tiny shape in seconds (what tests/unit/test_train_step.py runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eagle3_pipeline.train.data import PackedBatch  # noqa: E402
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3_pipeline.train.model_mla import Eagle3MLAAttention  # noqa: E402
from eagle3_pipeline.train.step import DEFAULT_MLP_RECOMPUTE, StepRunner  # noqa: E402
from eagle3_pipeline.train.variants import VARIANTS, variant_flags  # noqa: E402

H200_BF16_PEAK = 989.4e12
TTT = 7
LR = 1e-4
GRAD_CLIP = 0.5


@dataclass
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    n_aux: int = 3
    rope_theta: float = 500000.0
    mla: dict | None = None  # the MLA layout's sizes (q_lora_rank, kv_lora_rank, qk_nope/rope_head_dim, v_head_dim)
    variant: str = "eagle3"

    def drafter_config(self) -> DrafterConfig:
        return DrafterConfig(hidden_size=self.hidden, num_attention_heads=self.heads,
                             num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                             intermediate_size=self.intermediate, target_hidden_size=self.hidden,
                             num_aux_hidden_states=self.n_aux, vocab_size=self.vocab,
                             draft_vocab_size=self.draft_vocab, rms_norm_eps=1e-5, rope_theta=self.rope_theta,
                             max_position_embeddings=131072, **variant_flags(self.variant),
                             **({"layout": "mla", **self.mla} if self.mla else {}))

    def flops_per_token(self, ttt: int) -> float:
        """The MFU numerator (see the module docstring)."""
        h, i = self.hidden, self.intermediate
        attention = 2 * h * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * h
        if self.mla:  # the MLA projections' parameters, counted on the attention module itself
            attention = sum(p.numel() for p in Eagle3MLAAttention(self.drafter_config()).parameters())
        midlayer = attention + 3 * h * i
        lm_head = h * self.draft_vocab
        fc = self.n_aux * h * h
        return 3 * 2 * (ttt * (midlayer + lm_head) + fc) + 2 * h * (self.draft_vocab + self.vocab)


LLAMA_8B = Shape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, draft_vocab=32000)
# SmolLM2-135M-Instruct's drafter: the target's shape (hidden 576, 9/3 heads, MLP 1536), vocabulary 49152.
SMOLLM2 = Shape(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, draft_vocab=32000,
                rope_theta=100000.0)
TINY = Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512, draft_vocab=128)
TINY_MLA = Shape(hidden=64, intermediate=128, heads=4, kv_heads=4, head_dim=24, vocab=512, draft_vocab=512,
                 mla={"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                      "v_head_dim": 16})
# Kimi-K2.5's MLA drafter (the public kimi-k2.5-eagle3-mla's shape, inventory/examples/kimi-k2.5-8gpu.yml): the
# target's width and dense MLP (7168, 18432), DeepSeek-V3's multi-latent attention (64 heads, q/kv latents 1536/512,
# nope/rope/v head dims 128/64/128; RoPE theta 50000, YaRN left out: it only changes the frequencies' values),
# the whole 163840-token vocabulary as draft vocabulary.
KIMI_MLA = Shape(hidden=7168, intermediate=18432, heads=64, kv_heads=64, head_dim=192, vocab=163840,
                 draft_vocab=163840, rope_theta=50000.0,
                 mla={"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                      "v_head_dim": 128})
SHAPES = {"llama-8b": LLAMA_8B, "smollm2": SMOLLM2, "kimi-mla": KIMI_MLA}


def random_batches(shape: Shape, seq_len: int, docs: int, count: int, seed: int, pin: bool) -> list[PackedBatch]:
    """``count`` random packed batches of ``seq_len`` tokens, ``docs`` samples each, in host memory."""
    generator = torch.Generator().manual_seed(seed)
    bounds = torch.linspace(0, seq_len, docs + 1).long()
    doc_ids = torch.repeat_interleave(torch.arange(docs), bounds[1:] - bounds[:-1])
    positions = torch.arange(seq_len) - bounds[doc_ids]
    batches = []
    for _ in range(count):
        tensors = {
            "input_ids": torch.randint(0, shape.vocab, (seq_len,), generator=generator),
            "loss_mask": torch.ones(seq_len, dtype=torch.bool),
            "aux_hidden": torch.randn(seq_len, shape.n_aux * shape.hidden, generator=generator).to(torch.bfloat16),
            "last_hidden": torch.randn(seq_len, shape.hidden, generator=generator).to(torch.bfloat16),
            "doc_ids": doc_ids.clone(),
            "position_ids": positions.clone(),
        }
        if pin:
            tensors = {name: t.pin_memory() for name, t in tensors.items()}
        batches.append(PackedBatch(**tensors, sample_ids=[f"random-{i}" for i in range(docs)]))
    return batches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, step, batches: list[PackedBatch], warmup: int, steps: int, device: torch.device,
            flops_per_token: float) -> dict:
    """Run ``step(batch)`` warmup + steps times; tokens/s of the timed ones, peak memory of all."""
    started = time.perf_counter()
    for index in range(warmup):
        step(batches[index % len(batches)])
    synchronize(device)
    warm = time.perf_counter() - started
    started = time.perf_counter()
    for index in range(steps):
        step(batches[index % len(batches)])
    synchronize(device)
    elapsed = time.perf_counter() - started
    tokens = sum(batches[i % len(batches)].num_tokens for i in range(steps))
    result = {"impl": name, "tokens_per_s": tokens / elapsed, "step_ms": 1000 * elapsed / steps,
              "warmup_s": warm, "steps": steps, "warmup": warmup}
    result["mfu"] = result["tokens_per_s"] * flops_per_token / H200_BF16_PEAK
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return result


def fresh_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_ours(shape: Shape, batches, args, device: torch.device, recompute: int, attention: str) -> dict:
    """Our StepRunner.train_step, built the way the trainer builds it."""
    fresh_memory(device)
    torch.manual_seed(0)
    model = Eagle3Drafter(shape.drafter_config())  # fp32 on the CPU, then moved: as the trainer does
    model.to(device)
    lm_head = (torch.randn(shape.vocab, shape.hidden, device=device) * 0.02).to(
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    runner = StepRunner(model, lm_head, ttt_length=TTT, device=device, dtype=dtype, parallel="ddp",
                        attention=attention, compile=not args.no_compile and device.type == "cuda",
                        mlp_recompute_steps=recompute)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    fresh_memory(device)
    losses = []

    def step(batch):
        loss, _ = runner.train_step(batch, optimizer, LR, GRAD_CLIP)
        losses.append(loss.loss.detach())

    label = f"ours ({runner.attention}, recompute {recompute}/{TTT}{', compiled' if runner.compile else ''})"
    result = measure(label, step, batches, args.warmup, args.steps, device, shape.flops_per_token(TTT))
    result["loss_first_last"] = [float(losses[0]), float(losses[-1])]
    if args.profile:
        result["profile"] = profile_steps(step, batches, args.profile, device)
    return result


def profile_steps(step, batches, steps: int, device: torch.device, rows: int = 25) -> dict:
    """``steps`` more steps under torch.profiler: where a step's time goes. On CUDA: the kernels' time a step
    against its wall time (a step whose kernels take much less than its wall time waits on the host) and the
    kernels launched a step; the operators with the most device (CUDA) or CPU time, as a table."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for index in range(steps):
            step(batches[index % len(batches)])
        synchronize(device)
        wall = time.perf_counter() - started
    kernels = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
    kernel_ms = sum(event.time_range.elapsed_us() for event in kernels) / 1000
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows)
    summary = {"steps": steps, "wall_ms_per_step": 1000 * wall / steps, "kernel_ms_per_step": kernel_ms / steps,
               "kernels_per_step": len(kernels) / steps}
    print(f"profile, {steps} steps: {summary['wall_ms_per_step']:.1f} ms a step (under the profiler), kernels "
          f"{summary['kernel_ms_per_step']:.1f} ms a step ({summary['kernels_per_step']:.0f} launched a step)\n{table}",
          flush=True)
    return summary


def import_specforge(path: str):
    """SpecForge's modules, or the reason they cannot be imported."""
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: PLC0415
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415
        from specforge.modeling.target.target_head import TargetHead  # noqa: PLC0415
        from specforge.optimizer import BF16Optimizer  # noqa: PLC0415
        from specforge.runtime.contracts import TrainBatch  # noqa: PLC0415
        from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - any import failure means "not measurable here"
        return None, f"{type(exc).__name__}: {exc}"
    return {"OnlineEagle3Model": OnlineEagle3Model, "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3,
            "TargetHead": TargetHead, "BF16Optimizer": BF16Optimizer, "TrainBatch": TrainBatch,
            "Eagle3TrainStrategy": Eagle3TrainStrategy}, None


def run_specforge(sf: dict, backend: str, shape: Shape, batches, args, device: torch.device) -> dict:
    """SpecForge 0.2.0's training step for one micro-batch, compact teacher, ``backend`` attention."""
    from transformers import LlamaConfig  # noqa: PLC0415

    fresh_memory(device)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, vocab_size=shape.vocab, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=shape.rope_theta, hidden_act="silu",
                         tie_word_embeddings=False, pretraining_tp=1)
    config.draft_vocab_size = shape.draft_vocab
    config.target_hidden_size = shape.hidden
    draft = sf["LlamaForCausalLMEagle3"](config, attention_backend=backend)
    draft.t2d.zero_()
    draft.t2d[: shape.draft_vocab] = True  # d2t stays 0: the draft vocabulary is the first ids, as in ours
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=torch.bfloat16)
    model = sf["OnlineEagle3Model"](draft, length=TTT, attention_backend=backend).to(device=device,
                                                                                       dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        target_head = sf["TargetHead"](folder)
    target_head.freeze_weights()
    target_head = target_head.eval().to(device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(target_head.fc.weight, std=0.02)
    strategy = sf["Eagle3TrainStrategy"](model, target_head=target_head, compact_teacher=True)
    optimizer = sf["BF16Optimizer"](model, lr=LR, max_grad_norm=GRAD_CLIP, total_steps=10_000, warmup_ratio=0.0)
    fresh_memory(device)
    losses = []

    def step(batch: PackedBatch):
        tensors = {"input_ids": batch.input_ids[None], "attention_mask": torch.ones_like(batch.input_ids)[None],
                   "loss_mask": batch.loss_mask[None].long(), "hidden_state": batch.aux_hidden[None],
                   "target": batch.last_hidden[None]}
        out = strategy.forward_loss(sf["TrainBatch"](sample_ids=batch.sample_ids, strategy="eagle3", tensors=tensors,
                                                     metadata={"target_repr": "hidden_state"}))
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.detach())

    result = measure(f"specforge-{backend}", step, batches, args.warmup, args.steps, device,
                     shape.flops_per_token(TTT))
    result["loss_first_last"] = [float(losses[0]), float(losses[-1])]
    return result


def report(result: dict) -> str:
    line = (f"{result['impl']:<44} {result['seq_len']:>6} tokens/step {result['tokens_per_s']:>10,.0f} tokens/s  "
            f"{result['step_ms']:8.1f} ms/step  "
            f"MFU {100 * result['mfu']:5.1f}%")
    if "peak_allocated_gib" in result:
        line += (f"  peak allocated {result['peak_allocated_gib']:.2f} GiB, reserved "
                 f"{result['peak_reserved_gib']:.2f} GiB")
    return line + f"  (warm-up {result['warmup']} steps: {result['warmup_s']:.1f} s)"


def run_all(shape: Shape, batches, impls: list[str], args, device: torch.device, seq_len: int) -> list[dict]:
    """Every implementation asked for, over the same batches of ``seq_len`` tokens."""
    results = []
    if "ours" in impls:
        for attention in args.attention:
            for recompute in args.mlp_recompute_steps:
                results.append({**run_ours(shape, batches, args, device, recompute, attention), "seq_len": seq_len})
                print(report(results[-1]), flush=True)
                fresh_memory(device)
    specforge_impls = [name for name in impls if name.startswith("specforge-")]
    if specforge_impls:
        sf, why = import_specforge(args.specforge_path) if device.type == "cuda" else (None, "needs CUDA")
        if sf is None:
            print(f"SpecForge not measured: cannot import specforge 0.2.0 from {args.specforge_path} ({why})",
                  flush=True)
        for name in specforge_impls if sf is not None else []:
            try:
                results.append({**run_specforge(sf, name.removeprefix("specforge-"), shape, batches, args, device),
                                "seq_len": seq_len})
                print(report(results[-1]), flush=True)
            except Exception as exc:  # noqa: BLE001 - report and carry on with the others
                print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
            fresh_memory(device)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens there)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048],
                        help="tokens per step; several: each implementation runs once per value (a batch sweep)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="the drafter's shape")
    parser.add_argument("--docs", type=int, default=1, help="samples packed into each step's tokens")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="eagle3", help="ours: the drafter variant")
    parser.add_argument("--impls", default="ours,specforge-flex_attention,specforge-sdpa",
                        help="comma-separated: ours, specforge-flex_attention, specforge-sdpa")
    parser.add_argument("--mlp-recompute-steps", type=int, nargs="+", default=[DEFAULT_MLP_RECOMPUTE],
                        help="ours: run once per value")
    parser.add_argument("--no-compile", action="store_true", help="ours: no torch.compile")
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "sdpa", "fused"],
                        help="ours: StepRunner's attention, run once per value (auto: fused on CUDA)")
    parser.add_argument("--specforge-path", default="/tmp/sf", help="where specforge 0.2.0 is installed")
    parser.add_argument("--tiny", action="store_true", help="ours only, a tiny shape on the CPU")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="ours: then STEPS more steps under torch.profiler (kernel time against wall time a step, "
                             "the operators that take the most)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    shape = replace(SHAPES[args.shape], variant=args.variant)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    if shape.mla and any(name.startswith("specforge") for name in impls):
        print("SpecForge 0.2.0 trains no MLA drafter (its drafts are Llama-attention EAGLE-3, DFlash and P-EAGLE): "
              "ours alone", flush=True)
        impls = [name for name in impls if not name.startswith("specforge")]
    if args.tiny:
        shape, device, impls = replace(TINY_MLA if shape.mla else TINY, variant=args.variant), torch.device("cpu"), \
            ["ours"]
        args.attention = ["sdpa"] if shape.mla else ["sdpa", "fused"]
        args.seq_len = [min(length, 64) for length in args.seq_len]
        args.docs = max(args.docs, 2)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}; shape {shape}; TTT {TTT}; {args.seq_len} tokens/step in {args.docs} sample(s); "
          f"warm-up {args.warmup}, timed {args.steps} steps", flush=True)
    flops = shape.flops_per_token(TTT)
    print(f"MFU: FLOPs/token = 3 x 2 x (TTT x (midlayer + lm_head params) + fc params) + 2 x H x (D + V) = "
          f"{flops / 1e9:.2f} GFLOP; peak {H200_BF16_PEAK / 1e12:.1f} TFLOP/s (H100/H200 SXM dense BF16)", flush=True)
    results = []
    for seq_len in args.seq_len:
        batches = random_batches(shape, seq_len, args.docs, 4, seed=0, pin=device.type == "cuda")
        results += run_all(shape, batches, impls, args, device, seq_len)
        del batches
    for ours in (r for r in results if r["impl"].startswith("ours")):
        for other in (r for r in results if r["impl"].startswith("specforge") and r["seq_len"] == ours["seq_len"]):
            print(f"ratio {ours['impl']} / {other['impl']}: {ours['tokens_per_s'] / other['tokens_per_s']:.2f}x "
                  "tokens/s", flush=True)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
