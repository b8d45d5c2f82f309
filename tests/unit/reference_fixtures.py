"""What the reference engine's tests share: a tiny random Llama with a word-level tokenizer, a server subprocess
with a small HTTP client, and checks of its outputs against transformers in the test's own process."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from float_rounding import dot_error_bound

from eagle3_pipeline.extract.verify import check_top1

API_KEY_ENV = "E3_REFERENCE_TEST_KEY"
API_KEY = "test-key-7f3a"
AUX_LAYERS = [0, 2, 4]
HIDDEN = 64
START_TIMEOUT_S = 180.0  # a loaded 2-core machine: torch, transformers and the start-up check
# The engine's hidden states against transformers' (float32 both, other kernels: padded batches, a KV
# cache), as the capture tests below assert them.
HIDDEN_RTOL, HIDDEN_ATOL = 1e-4, 1e-5


def build_tiny_llama(path: Path) -> Path:
    """A random-weight LlamaForCausalLM and a word-level tokenizer ("w0".."w251"), saved HF-style in ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(252)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tiny_llama(tiny_model_dir: Path):
    """The same model, in this process, to check a server against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()


class Server:
    """A reference server subprocess and a small HTTP client for it."""

    def __init__(self, workdir: Path, model_dir: Path, *options: str, env: dict | None = None):
        self.log_file = workdir / "server.log"
        self.stderr = open(workdir / "stderr.txt", "w")  # noqa: SIM115 - closed in stop()
        command = [
            sys.executable, "-m", "eagle3_pipeline.engine.reference_server", "--model-path", str(model_dir),
            "--port", "0", "--log-file", str(self.log_file), *options,
        ]
        self.proc = subprocess.Popen(command, stdout=self.stderr, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.port = self._wait_for_port()
        self.headers = {}

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}: {self.read_log()}")
            if self.log_file.exists():
                match = re.search(r"serving http://[\d.]+:(\d+)", self.log_file.read_text())
                if match:
                    return int(match.group(1))
            time.sleep(0.1)
        raise AssertionError(f"server did not start within {START_TIMEOUT_S} s: {self.read_log()}")

    def read_log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else "(no log)"

    def call(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
        """(status, parsed JSON body or None)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        connection.request(method, path, body=data, headers={**self.headers, **(headers or {})})
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        return response.status, (json.loads(payload) if payload else None)

    def generate(self, body, **kwargs):
        return self.call("POST", "/generate", body, **kwargs)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()
        return self.proc.returncode


def expected_states(hf_model, ids):
    """(aux [T, 3H], last [T, H], logits [T, V]) computed by transformers in this process."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1][0] for i in AUX_LAYERS], dim=-1)
    return aux, out.hidden_states[-1][0], out.logits[0]


def logits_apart(hf_model, last: torch.Tensor) -> float:
    """How far the engine's logits may be from transformers' for hidden states ``last`` [T, H]: their hidden
    states differ by at most HIDDEN_ATOL + HIDDEN_RTOL |h|, which lm_head weighs by |W|, and each side's
    lm_head matmul rounds by float32's bound for an H-term dot product."""
    weight = hf_model.lm_head.weight.detach()
    moved = (HIDDEN_ATOL + HIDDEN_RTOL * last.double().abs()) @ weight.double().abs().T
    return float((moved + 2 * dot_error_bound(last, weight)).max())


def assert_greedy_continuation(hf_model, ids: list[int], output: list[int]) -> None:
    """Each token of ``output`` is transformers' top-1 after ``ids`` and the output tokens before it.

    Up to float32: where transformers' two best logits are within twice ``logits_apart`` of each other,
    either is a correct greedy choice for an engine computing in another order, and the two decodes
    legitimately part there. A token chosen without its context (positions, cache, padding) loses by
    far more.
    """
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids + output[:-1]]), output_hidden_states=True)
    last = out.hidden_states[-1][0, len(ids) - 1:]  # the rows that chose the output tokens
    check_top1(last, hf_model.lm_head.weight.detach(), 0, output, tolerance=2 * logits_apart(hf_model, last))


def prompt(length: int, offset: int = 4) -> list[int]:
    return [4 + (offset + 7 * i) % 252 for i in range(length)]
