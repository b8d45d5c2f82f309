"""The SGLang 0.5.23 launch command for full-sequence hidden-state capture, and its checks.

Plain functions over values (no torch, no sglang import); the role reaches them through the
server plan (``python -m eagle3_pipeline.serve.plan``), and tests call them directly. Every
fact below was read in the SGLang 0.5.23 wheel (paths under ``sglang/srt/``); the contract
tests in ``tests/sglang/`` check the parser-level ones against the real wheel.

Flags (``server_args.py`` + ``arg_groups/fields/*.py``):

- ``--disable-radix-cache`` (fields/memory.py ``disable_radix_cache``): no prefix reuse, so every
  prompt token is computed in this request's own EXTEND pass.
- ``--chunked-prefill-size -1`` (fields/schedule.py ``chunked_prefill_size``;
  managers/scheduler.py turns a value <= 0 into ``None``: no chunking).
- CUDA graphs off: ``--disable-cuda-graph`` is deprecated in 0.5.23 (server_args.py
  ``ServerArgs.add_cli_args`` registers it with ``DeprecatedStoreTrueAction`` pointing at
  ``--cuda-graph-backend-{decode,prefill}=disabled``), so we pass
  ``--cuda-graph-backend-prefill disabled --cuda-graph-backend-decode disabled``
  (fields/exec_.py ``ExecGraph``). ``--cuda-graph-config`` JSON wins over those flags
  (its help text), hence it is refused in extras. Graphs matter because forward hooks are
  registered after graph capture and never run inside a replay
  (model_executor/model_runner_components/cuda_graph_setup.py ``finalize_cuda_graph_capture``).
- ``--disable-custom-all-reduce`` (fields/exec_.py ``ExecComm``).
- ``--enable-return-aux-hidden-states`` NEEDS ``--speculative-algorithm EAGLE3``: in capture
  mode the algorithm only names the capture convention and resolution resets it to ``None``
  (arg_groups/validation_hook.py ``handle_aux_hidden_state_capture``: EAGLE3, DFLASH or DSPARK;
  a draft model path or ``pp_size != 1`` is refused; ids must be non-empty, non-negative and
  unique; EAGLE3 alone may omit them and then gets the model's default layers).
  ``/server_info`` therefore shows ``speculative_algorithm: null`` and
  ``aux_hidden_state_capture: "eagle3"``.
- ``--return-aux-hidden-state-layer-ids`` takes space-separated ints (``nargs='+'``, type int);
  each must be < num_hidden_layers (model_executor/model_runner_components/
  spec_aux_hidden_state.py ``_check_capture_layer_ids_in_range``).
- ``--forward-hooks`` takes a JSON list (utils/common.py ``json_list_type``) of
  ``{"name", "target_modules": [fnmatch patterns], "hook_factory": "module:callable",
  "config": {...}}`` (model_executor/hook_manager.py ``register_forward_hooks``).

Layer ids. DESIGN.md's ``aux_layers`` are 0-based decoder layers whose OUTPUT is captured
(HF ``hidden_states[i + 1]``). SGLang's meaning differs per model class:

- llama (models/llama.py ``LlamaForCausalLM.set_eagle3_layers_to_capture``): with explicit ids,
  ``layers_to_capture = [id + 1 ...]``, and ``LlamaModel.forward`` captures the INPUT of each
  layer in ``layers_to_capture`` (``LlamaDecoderLayer.forward``:
  ``attn_boundary.prepare(..., capture=capture_output)``), i.e. the output of layer ``id``.
  So SGLang id == our id. The last layer (num_hidden_layers - 1) cannot be captured: no layer
  follows it (layers/logits_processor.py ``_check_aux_hidden_states`` fails the first forward).
- deepseek_v2 / deepseek_v3 / kimi_k2 / kimi_k25 (models/deepseek_v2.py
  ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``, used through
  models/kimi_k25.py ``KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture``):
  ``layers_to_capture = [id + 1 ...]`` only when ``ids[0] == 1``, else ``list(ids)``; the
  decoder layer captures its INPUT (``DeepseekV2DecoderLayer.forward``:
  ``attn_boundary.prepare(..., capture_gathered=captured_last_layer_outputs)``). We always pass
  ``[a + 1 for a in aux_layers]``: it never starts with 1 unless aux_layers starts with 0, which
  is refused (that set is not expressible through this rule in sorted order).
- Captures are appended in layer order (the decoder loop), so aux_layers must be ascending.

API key. SGLang 0.5.23 has no environment variable for the API key (fields/serving.py
``api_key`` is only ``--api-key``; environ.py has none). ``prepare_server_args`` merges a YAML
``--config FILE`` into argv in memory (utils/server_args_config_parser.py
``ConfigArgumentMerger``: suffix .yaml/.yml, CLI wins over the file), so the key goes in a
0600 YAML file (``api_key_config_text``) and argv carries only ``--config PATH``. Caveat: SGLang
then records the merged argv as ``launch_command``, and ``/server_info`` returns it and the
``api_key`` field (utils/common.py ``build_server_info``: ``resolved_dict()`` +
``launch_command``); the API-key middleware guards that endpoint when a key is set.

``/server_info`` (entrypoints/http_server.py ``server_info``) is ``build_server_info``: the
resolved ServerArgs fields by field name, plus ``launch_command``, scheduler info and
``version``; ``expected_server_info`` lists what the role must find there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from eagle3_pipeline.capture.layers import check_aux_layers

SGLANG_VERSION = "0.5.23"
HOOK_FACTORY = "eagle3_pipeline.capture.sglang_hook:make_capture_hook"
HOOK_NAME = "eagle3_pipeline_capture"
# LlamaForCausalLM / DeepseekV2ForCausalLM own `logits_processor`; KimiK25ForConditionalGeneration
# holds the DeepseekV3ForCausalLM as `language_model` (models/kimi_k25.py).
HOOK_TARGET_MODULES = ("logits_processor", "language_model.logits_processor")

# model_type (config.json) -> how SGLang's EAGLE3 layer ids map to ours; see the module docstring.
LAYER_ID_CONVENTIONS = {
    "llama": "same",
    "deepseek_v2": "plus_one",
    "deepseek_v3": "plus_one",
    "kimi_k2": "plus_one",
    "kimi_k25": "plus_one",
}

# Flags the command sets; a user extra may not repeat or override them (aliases included).
_SET_FLAGS = {
    "--model-path": "set from sglang_server_model_path",
    "--model": "alias of --model-path, which the role sets",
    "--host": "set from sglang_server_host",
    "--port": "set from sglang_server_port",
    "--tp-size": "set from sglang_server_tp_size",
    "--tensor-parallel-size": "alias of --tp-size, which the role sets",
    "--dp-size": "set from sglang_server_dp_size",
    "--data-parallel-size": "alias of --dp-size, which the role sets",
    "--disable-radix-cache": "already set: capture needs every prompt token computed in its own request",
    "--chunked-prefill-size": "already set to -1: a chunked prefill splits one request's capture",
    "--cuda-graph-backend-prefill": "already set to disabled: forward hooks never run inside a graph replay",
    "--cuda-graph-backend-decode": "already set to disabled",
    "--disable-custom-all-reduce": "already set",
    "--enable-return-aux-hidden-states": "already set",
    "--speculative-algorithm": "already set to EAGLE3, which names the capture convention",
    "--return-aux-hidden-state-layer-ids": "set from sglang_server_aux_layers (converted per model class)",
    "--forward-hooks": "already set to this pipeline's capture hook; a second spec would replace it",
    "--config": "used by the role for the API key file; a config file could set any flag unchecked",
    "--api-key": "would show the key in the process list: set sglang_server_api_key instead",
}

# Flags that would undo capture; each with why. Derived from server_args.py's parser (0.5.23):
# everything that reuses a cached prefix, splits or mixes a prefill, turns graphs back on,
# changes the speculative/capture setup, or shards/splits the hidden states the hook sees.
_REFUSED_FLAGS = {
    # prefix reuse: a cached prefix is never recomputed, so its rows are never captured
    "--enable-hierarchical-cache": "reuses cached prefixes (HiCache)",
    "--enable-hicache": "reuses cached prefixes (HiCache)",
    "--enable-lmcache": "reuses cached prefixes (LMCache)",
    "--lmcache-config-file": "configures LMCache prefix reuse",
    "--radix-cache-backend": "selects a prefix cache",
    "--enable-session-radix-cache": "reuses cached session prefixes",
    "--enable-unified-cache-external-linker": "reuses prefixes from an external KV store",
    "--disaggregation-decode-enable-radix-cache": "reuses cached prefixes on a PD decode server",
    "--enable-prefix-mm-cache": "reuses cached multimodal prefixes",
    # split or mixed prefill: one request's tokens spread over several passes
    "--enable-mixed-chunk": "mixes prefill chunks with decode rows in one batch",
    "--enable-dynamic-chunking": "chunks prefills dynamically",
    "--enable-pdmux": "runs split prefills (PD multiplexing)",
    "--enable-prefill-cp": "shards each prefill's tokens over context-parallel ranks",
    "--attn-cp-size": "shards attention over context-parallel ranks",
    "--attention-context-parallel-size": "shards attention over context-parallel ranks",
    "--dcp-size": "shards the KV cache over decode-context-parallel ranks",
    "--decode-context-parallel-size": "shards the KV cache over decode-context-parallel ranks",
    "--enable-mis": "packs several items into one sequence (multi-item scoring)",
    "--dllm-algorithm": "runs diffusion-LLM extends, not one EXTEND per prompt",
    "--disaggregation-mode": "splits prefill and decode over servers; capture runs on one plain server",
    "--is-embedding": "serves through the pooler, never the logits_processor the hook is on",
    # graphs and compilation: hooks do not run inside replays or compiled regions
    "--cuda-graph-config": "its JSON wins over the disabled graph backends",
    "--disable-cuda-graph": "deprecated in 0.5.23; the role already disables both graph phases",
    "--debug-cuda-graph": "runs through the CUDA graph path",
    "--enable-torch-compile": "compiled regions may skip Python forward hooks",
    # parallel layouts that hand the hook a shard, or split requests away from TP rank 0
    "--pp-size": "pipeline parallelism: SGLang's aux capture needs pp_size 1",
    "--pipeline-parallel-size": "pipeline parallelism: SGLang's aux capture needs pp_size 1",
    "--attn-dp-size": "attention DP gives TP rank 0 only its own share of the requests",
    "--attention-data-parallel-size": "attention DP gives TP rank 0 only its own share of the requests",
    "--enable-dp-attention": "attention DP gives TP rank 0 only its own share of the requests",
    "--enable-dp-lm-head": "an attention-DP layout of the LM head",
    "--enable-layernorm-sp": "hands the logits processor sequence-sharded hidden states",
    "--enable-attn-tp-input-scattered": "scatters the hidden states over attention-TP ranks",
    "--enable-two-batch-overlap": "splits each batch into micro-batches",
}
# Every speculative flag: the role owns the algorithm, and a draft is refused by SGLang anyway.
_REFUSED_PREFIXES = {
    "--speculative-": "changes the speculative setup, which in capture mode only names the convention",
    "--cuda-graph-": "configures the CUDA graphs the role turns off",
    "--hicache-": "configures prefix reuse (HiCache)",
    "--unified-cache-external-linker-": "configures prefix reuse from an external KV store",
}
# Real 0.5.23 flags that are strict prefixes of a refused flag: spelled in full, argparse takes
# them as themselves, so they are not abbreviations (the contract test keeps this list true).
_FULL_FLAGS_PREFIXING_REFUSED: frozenset[str] = frozenset()


def _check_aux_layers(aux_layers: Sequence[int], num_hidden_layers: int | None) -> list[int]:
    """The project's range rule (capture.layers), plus SGLang's: distinct ids in ascending order."""
    layers = [int(a) for a in aux_layers]
    if num_hidden_layers is not None:
        check_aux_layers(layers, num_hidden_layers)
    if not layers:
        raise ValueError("aux_layers is empty: name the decoder layers to capture, e.g. [1, 30, 57]")
    if any(a < 0 for a in layers) or layers != sorted(set(layers)):
        raise ValueError(
            f"aux_layers {layers}: use distinct non-negative layer indices in ascending order "
            "(SGLang concatenates captures in layer order)"
        )
    return layers


def sglang_layer_ids(aux_layers: Sequence[int], model_type: str, num_hidden_layers: int | None = None) -> list[int]:
    """Convert our aux layer ids (0-based, output of that layer) to SGLang's EAGLE3 ids.

    llama: SGLang id == ours (models/llama.py adds 1 and captures layer inputs).
    deepseek_v2/v3, kimi_k2, kimi_k25: SGLang id == ours + 1 (models/deepseek_v2.py captures layer
    inputs and adds 1 only when the first id is 1, which ours + 1 never is once 0 is refused).
    """
    layers = _check_aux_layers(aux_layers, num_hidden_layers)
    convention = LAYER_ID_CONVENTIONS.get(model_type)
    if convention is None:
        raise ValueError(
            f"model_type {model_type!r}: no SGLang {SGLANG_VERSION} layer-id convention is recorded for it; "
            f"known: {sorted(LAYER_ID_CONVENTIONS)}. Read that model's set_eagle3_layers_to_capture in "
            "sglang/srt/models/ and add it to LAYER_ID_CONVENTIONS"
        )
    if convention == "same":
        return layers
    if layers[0] == 0:
        raise ValueError(
            f"aux_layers {layers}: SGLang {SGLANG_VERSION} cannot capture the output of layer 0 for {model_type} "
            "(DeepseekV2ForCausalLM.set_eagle3_layers_to_capture adds 1 when the first id is 1); start at layer 1"
        )
    return [a + 1 for a in layers]


def hook_spec(capture_dir: str, aux_layers: Sequence[int], sglang_ids: Sequence[int], model_type: str) -> dict:
    """The ``--forward-hooks`` entry naming this package's capture hook and its config."""
    return {
        "name": HOOK_NAME,
        "target_modules": list(HOOK_TARGET_MODULES),
        "hook_factory": HOOK_FACTORY,
        "config": {
            "capture_dir": str(capture_dir),
            "aux_layer_ids": [int(a) for a in aux_layers],
            "sglang_layer_ids": [int(i) for i in sglang_ids],
            "model_type": model_type,
            "engine": f"sglang-{SGLANG_VERSION}",
        },
    }


def api_key_config_text(api_key: str) -> str:
    """YAML for the ``--config`` file that carries the API key (write it mode 0600)."""
    if not api_key or "\n" in api_key:
        raise ValueError("the API key must be a non-empty single line")
    return f"api-key: {json.dumps(api_key)}\n"  # a JSON string is a valid YAML scalar


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def _refusal(flag: str) -> str | None:
    if flag in _SET_FLAGS:
        return f"{flag} is set by the sglang_server role ({_SET_FLAGS[flag]}); remove it from sglang_server_extra_args"
    if flag in _REFUSED_FLAGS:
        return (
            f"{flag} would undo full-sequence capture ({_REFUSED_FLAGS[flag]}); remove it from sglang_server_extra_args"
        )
    for prefix, why in _REFUSED_PREFIXES.items():
        if flag.startswith(prefix):
            return f"{flag} would undo full-sequence capture ({why}); remove it from sglang_server_extra_args"
    if flag not in _FULL_FLAGS_PREFIXING_REFUSED:
        known = [*_SET_FLAGS, *_REFUSED_FLAGS, *_REFUSED_PREFIXES]
        expands_to = sorted(k for k in known if k.startswith(flag) and k != flag)
        if expands_to:
            return (
                f"{flag} is an abbreviation SGLang's argparse may expand to {expands_to[0]}, which the role "
                "refuses; spell flags in full"
            )
    return None


def check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse user extras that would undo capture or repeat a flag the role sets (ValueError).

    ``extra_args`` is an argv list (one token per item), never a shell string.
    """
    if isinstance(extra_args, str):
        raise ValueError("sglang_server_extra_args must be a list of argv tokens, not a string")
    for token in extra_args:
        if not isinstance(token, str):
            raise ValueError(f"sglang_server_extra_args: {token!r} is not a string; quote every token")
        if token.startswith("--"):
            reason = _refusal(_flag_name(token))
            if reason:
                raise ValueError(reason)
        elif token.startswith("-") and len(token) > 1 and not token[1].isdigit() and token[1] != ".":
            raise ValueError(f"{token}: use long flags only in sglang_server_extra_args (short options are ambiguous)")


def _check_endpoint(tp_size: int, port: int) -> None:
    if int(tp_size) < 1 or not 0 < int(port) < 65536:
        raise ValueError(f"tp_size {tp_size} must be >= 1 and port {port} in 1..65535")


def _server_head(python: str, model_path: str, host: str, port: int, tp_size: int) -> list[str]:
    """The start of every launch command: the module, the model, where it listens, its TP size."""
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", str(host),
            "--port", str(int(port)), "--tp-size", str(int(tp_size))]


def dp_args(dp_size: int) -> list[str]:
    """``--dp-size N``: N replicas of the model behind one endpoint, each on its own ``tp_size`` GPUs (SGLang's
    data-parallel controller spreads the requests over them); nothing for one replica."""
    if int(dp_size) < 1:
        raise ValueError(f"dp_size {dp_size} must be >= 1")
    return ["--dp-size", str(int(dp_size))] if int(dp_size) > 1 else []


def _config_args(api_key_config: str | None) -> list[str]:
    """``--config PATH`` for the API key's YAML file (SGLang reads --config only from .yaml/.yml), or nothing."""
    if api_key_config is None:
        return []
    if Path(api_key_config).suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"{api_key_config}: SGLang reads --config only from a .yaml/.yml file")
    return ["--config", str(api_key_config)]


def launch_argv(
    python: str,
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    aux_layers: Sequence[int],
    capture_dir: str,
    model_type: str = "llama",
    extra_args: Sequence[str] = (),
    api_key_config: str | None = None,
    num_hidden_layers: int | None = None,
) -> list[str]:
    """The SGLang launch command as an argv list (no shell).

    ``api_key_config`` is the path of a YAML file written with ``api_key_config_text`` (SGLang
    has no API-key environment variable); the key itself never appears in argv.
    """
    check_extra_args(extra_args)
    _check_endpoint(tp_size, port)
    ids = sglang_layer_ids(aux_layers, model_type, num_hidden_layers)
    spec = hook_spec(capture_dir, aux_layers, ids, model_type)
    argv = [
        *_server_head(python, model_path, host, port, tp_size),
        "--disable-radix-cache",
        "--chunked-prefill-size", "-1",
        "--cuda-graph-backend-prefill", "disabled",
        "--cuda-graph-backend-decode", "disabled",
        "--disable-custom-all-reduce",
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm", "EAGLE3",
        "--return-aux-hidden-state-layer-ids", *(str(i) for i in ids),
        "--forward-hooks", json.dumps([spec], separators=(",", ":")),
    ]  # fmt: skip
    argv += _config_args(api_key_config)
    return argv + list(extra_args)


def expected_server_info(
    model_path: str,
    port: int,
    tp_size: int,
    aux_layers: Sequence[int],
    capture_dir: str,
    model_type: str = "llama",
    num_hidden_layers: int | None = None,
) -> dict:
    """Fields the live ``/server_info`` must show (resolved ServerArgs field names), and values."""
    ids = sglang_layer_ids(aux_layers, model_type, num_hidden_layers)
    return {
        "version": SGLANG_VERSION,
        "model_path": str(model_path),
        "port": int(port),
        "tp_size": int(tp_size),
        "pp_size": 1,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "enable_mixed_chunk": False,
        "enable_hierarchical_cache": False,
        "enable_dp_attention": False,
        "cuda_graph_backend_prefill": "disabled",
        "cuda_graph_backend_decode": "disabled",
        "disable_custom_all_reduce": True,
        "enable_return_aux_hidden_states": True,
        "aux_hidden_state_capture": "eagle3",
        "speculative_algorithm": None,  # reset by handle_aux_hidden_state_capture
        "return_aux_hidden_state_layer_ids": ids,
        "forward_hooks": [hook_spec(capture_dir, aux_layers, ids, model_type)],
    }


# -- serving the target itself (regeneration) ---------------------------------------------------
# A server that answers, not one that captures: SGLang's defaults stay (radix cache on, so each
# turn of a conversation reuses the prefill of the turns before it; CUDA graphs on; chunked
# prefill at its default), and nothing of the capture is there (no aux hidden states, no hook).
_SERVE_SET_FLAGS = {
    "--model-path": "set from sglang_server_model_path",
    "--model": "alias of --model-path, which the role sets",
    "--host": "set from sglang_server_host",
    "--port": "set from sglang_server_port",
    "--tp-size": "set from sglang_server_tp_size",
    "--tensor-parallel-size": "alias of --tp-size, which the role sets",
    "--dp-size": "set from sglang_server_dp_size",
    "--data-parallel-size": "alias of --dp-size, which the role sets",
    "--config": "used by the role for the API key file; a config file could set any flag unchecked",
    "--api-key": "would show the key in the process list: set sglang_server_api_key instead",
    "--enable-return-aux-hidden-states": "a capture flag; the serving server captures nothing",
    "--return-aux-hidden-state-layer-ids": "a capture flag; the serving server captures nothing",
    "--forward-hooks": "the capture hook has no place in the serving server",
    "--disable-radix-cache": "the serving server keeps the radix cache: each turn reuses its history's prefill",
    "--disable-cuda-graph": "deprecated in 0.5.23; the serving server keeps CUDA graphs on for decoding speed",
}
_SERVE_REFUSED_PREFIXES = {
    "--speculative-": "speculative decoding is the evaluation's server; the serving server answers plainly",
}


def check_serve_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse extras of the serving launch that repeat a flag it sets, bring back a capture flag,
    or turn off what makes it fast (ValueError naming the flag and why)."""
    if isinstance(extra_args, str):
        raise ValueError("sglang_server_extra_args must be a list of argv tokens, not a string")
    known = [*_SERVE_SET_FLAGS, *_SERVE_REFUSED_PREFIXES]
    for token in extra_args:
        if not isinstance(token, str):
            raise ValueError(f"sglang_server_extra_args: {token!r} is not a string; quote every token")
        if not token.startswith("--"):
            if token.startswith("-") and len(token) > 1 and not token[1].isdigit() and token[1] != ".":
                raise ValueError(f"{token}: use long flags only in sglang_server_extra_args (short options are "
                                 "ambiguous)")
            continue
        flag = _flag_name(token)
        if flag in _SERVE_SET_FLAGS:
            raise ValueError(f"{flag} is refused for a serving server ({_SERVE_SET_FLAGS[flag]}); remove it from "
                             "sglang_server_extra_args")
        for prefix, why in _SERVE_REFUSED_PREFIXES.items():
            if flag.startswith(prefix):
                raise ValueError(f"{flag} is refused for a serving server ({why}); remove it from "
                                 "sglang_server_extra_args")
        expands_to = sorted(k for k in known if k.startswith(flag) and k != flag)
        if expands_to:
            raise ValueError(f"{flag} is an abbreviation SGLang's argparse may expand to {expands_to[0]}, which the "
                             "role refuses; spell flags in full")


def serve_launch_argv(
    python: str,
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    extra_args: Sequence[str] = (),
    api_key_config: str | None = None,
) -> list[str]:
    """SGLang serving the target for answers (regeneration), as an argv list (no shell): the model,
    where it listens, its TP size, the API key file; none of the capture flags."""
    check_serve_extra_args(extra_args)
    _check_endpoint(tp_size, port)
    argv = _server_head(python, model_path, host, port, tp_size) + _config_args(api_key_config)
    return argv + list(extra_args)


def expected_serve_server_info(model_path: str, port: int, tp_size: int) -> dict:
    """Fields the live ``/server_info`` of a serving server must show: no capture, the radix cache on."""
    return {
        "version": SGLANG_VERSION,
        "model_path": str(model_path),
        "port": int(port),
        "tp_size": int(tp_size),
        "disable_radix_cache": False,
        "enable_return_aux_hidden_states": False,
        "forward_hooks": None,
    }


# -- serving the trained drafter (the evaluation stage) ------------------------------------------
# SGLang 0.5.23's chain defaults (arg_groups/speculative_hook.py ``_auto_choose_speculative_params``
# returns (steps 3, topk 1, draft tokens 4) for most architectures; with topk 1 ``_handle_eagle_family``
# forces num_draft_tokens = num_steps + 1).
DEFAULT_SPECULATIVE_STEPS = 3
# Flags the speculative launch sets (a user extra may not repeat them), and capture-mode flags that
# contradict serving a draft model (handle_aux_hidden_state_capture refuses a draft path with them).
_SPECULATIVE_SET_FLAGS = {
    "--model-path": "set from the target model path",
    "--model": "alias of --model-path",
    "--host": "set (the evaluation server listens on 127.0.0.1 only)",
    "--port": "set from the evaluation's port",
    "--tp-size": "set from the tensor-parallel size",
    "--tensor-parallel-size": "alias of --tp-size",
    "--config": "used for the API key file; a config file could set any flag unchecked",
    "--api-key": "would show the key in the process list: give it through the API key file",
    "--enable-return-aux-hidden-states": "capture mode; SGLang refuses it together with a draft model",
    "--return-aux-hidden-state-layer-ids": "capture mode; the drafter's config names its layers",
    "--forward-hooks": "the capture hook has no place in the evaluation server",
}


def check_speculative_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse extras that repeat a flag of the speculative launch or change its speculative setup (ValueError)."""
    if isinstance(extra_args, str):
        raise ValueError("the extra arguments must be a list of argv tokens, not a string")
    known = [*_SPECULATIVE_SET_FLAGS, "--speculative-"]
    for token in extra_args:
        if not isinstance(token, str):
            raise ValueError(f"extra argument {token!r} is not a string; quote every token")
        if not token.startswith("--"):
            if token.startswith("-") and len(token) > 1 and not token[1].isdigit() and token[1] != ".":
                raise ValueError(f"{token}: use long flags only (short options are ambiguous)")
            continue
        flag = _flag_name(token)
        if flag in _SPECULATIVE_SET_FLAGS:
            raise ValueError(f"{flag} is set by the evaluation ({_SPECULATIVE_SET_FLAGS[flag]}); remove it")
        if flag.startswith("--speculative-"):
            raise ValueError(f"{flag}: the evaluation sets the speculative flags itself (EAGLE3, chain of "
                             "draft tokens, topk 1); remove it")
        expands_to = sorted(k for k in known if k.startswith(flag) and k != flag)
        if expands_to:
            raise ValueError(f"{flag} is an abbreviation SGLang's argparse may expand to {expands_to[0]}; "
                             "spell flags in full")


def speculative_launch_argv(
    python: str,
    model_path: str,
    drafter_path: str,
    port: int,
    tp_size: int = 1,
    num_steps: int = DEFAULT_SPECULATIVE_STEPS,
    extra_args: Sequence[str] = (),
    api_key_config: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """SGLang serving the target with the trained drafter: EAGLE3, a chain of ``num_steps`` drafts (topk 1,
    num_steps + 1 tokens verified per forward), as an argv list (no shell). No capture flags: this
    server decodes; its /generate meta_info carries ``spec_verify_ct`` and the acceptance histogram.
    """
    check_speculative_extra_args(extra_args)
    _check_endpoint(tp_size, port)
    if int(num_steps) < 1:
        raise ValueError(f"num_steps {num_steps}: draft at least one token per round")
    argv = [
        *_server_head(python, model_path, host, port, tp_size),
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(drafter_path),
        "--speculative-num-steps", str(int(num_steps)),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(int(num_steps) + 1),
    ]  # fmt: skip
    argv += _config_args(api_key_config)
    return argv + list(extra_args)
