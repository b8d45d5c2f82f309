"""The server plan: everything the sglang_server role needs to start and verify a server.

One call turns the role's variables into the exact argv to run, the live ``/server_info``
values that prove the capture settings took effect, the aux layers and sizes a probe checks,
and the probe's token ids. A server for serving (``purpose`` "serve", the regeneration's) gets
none of the capture: the engine's own defaults (radix cache and CUDA graphs on), no aux hidden
states, no hook, no capture directory, no probe; its live settings are checked for exactly that.
The role runs ``python -m eagle3_pipeline.serve.plan --json ...`` on the host and only acts on
the result, so all the logic is here, in tested Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.capture.layers import check_aux_layers, default_aux_layers
from eagle3_pipeline.cli_args import path_str
from eagle3_pipeline.models.config import text_config

ENGINES = ("sglang", "reference")
PURPOSES = ("capture", "serve")
# The reference engine's batch for serving: regeneration keeps many conversations in flight.
SERVE_MAX_BATCH_SIZE = 64
# A probe prompt of 32 token ids that exist in any vocabulary larger than 64.
PROBE_INPUT_IDS = list(range(16, 48))
# Flags of the reference engine that the role sets itself; extras may not repeat them.
REFERENCE_OWN_FLAGS = ("--model-path", "--host", "--port", "--capture-dir", "--aux-layers", "--device", "--api-key-env",
                       "--dp-size")
API_KEY_ENV = "EAGLE3_API_KEY"  # the reference engine reads its key from this variable


class PlanError(ValueError):
    """The variables cannot give a working server; the message names the variable and the fix."""


def read_model_config(model_path: str) -> dict:
    """The model's config.json (Hugging Face format)."""
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(
            f"sglang_server_model_path: {path} does not exist; point it at a Hugging Face model directory "
            "(or set sglang_server_build_tiny_model: true for the embedded tiny model)"
        ) from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"sglang_server_model_path: {path} is not valid JSON: {exc}") from exc


def reference_argv(python: str, model_path: str, host: str, port: int, aux_layers: list[int], capture_dir: str,
                   device: str, api_key: bool, extra_args: list[str], purpose: str = "capture",
                   dp_size: int = 1, request_tokens: int = 0) -> list[str]:
    """The reference engine's command line; for serving, without a capture directory and with a
    large batch (an extra ``--max-batch-size`` given after it wins), its KV slots sized to ``request_tokens``
    (the most a request holds, prompt and new tokens; 0: the engine's default; an extra ``--slot-tokens`` wins);
    ``dp_size`` replicas, one per GPU."""
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in REFERENCE_OWN_FLAGS:
            raise PlanError(
                f"sglang_server_extra_args: {flag} is set by the role itself; use the matching sglang_server_* variable"
            )
    argv = [python, "-m", "eagle3_pipeline.cli", "serve-reference", "--model-path", model_path, "--host", host,
            "--port", str(port)]
    if purpose == "capture":
        # The extraction's requests capture (transformers' path) and decode nothing: no slot cache to allocate.
        argv += ["--capture-dir", capture_dir, "--aux-layers", ",".join(map(str, aux_layers)), "--decode",
                 "transformers"]
    else:
        argv += ["--max-batch-size", str(SERVE_MAX_BATCH_SIZE)]
        if request_tokens > 0:
            # Slots no larger than a request needs: the same memory holds more of them (a request that finds no free
            # slot waits for one).
            argv += ["--slot-tokens", str(request_tokens)]
    argv += ["--device", device]
    if dp_size > 1:
        argv += ["--dp-size", str(dp_size)]
    if api_key:
        argv += ["--api-key-env", API_KEY_ENV]
    return argv + list(extra_args)


def server_plan(engine: str, python: str, model_path: str, host: str, port: int, capture_dir: str,
                aux_layers: list[int] | None = None, tp_size: int = 1, device: str = "auto",
                api_key_file: str | None = None, extra_args: list[str] | None = None,
                purpose: str = "capture", dp_size: int = 1, request_tokens: int = 0) -> dict:
    """Build the plan (a JSON-ready dict) or raise PlanError.

    ``purpose`` "capture" (the extraction's server) or "serve" (answers only: see the module docstring).
    ``request_tokens``: the most tokens one request to a serving server holds (prompt and new tokens; 0 not known).

    ``api_key_file`` is where the role will write the API key (never argv): for the reference
    engine an env file handed to the supervisor, for SGLang (which reads no key from the
    environment) a YAML file given to ``--config``. Its format is the plan's ``secret_format``.
    """
    api_key = api_key_file is not None
    if engine not in ENGINES:
        raise PlanError(f"sglang_server_engine: {engine!r} is not one of {', '.join(ENGINES)}")
    if purpose not in PURPOSES:
        raise PlanError(f"sglang_server_purpose: {purpose!r} is not one of {', '.join(PURPOSES)}")
    if not 1 <= port <= 65535:
        raise PlanError(f"sglang_server_port: {port} is not a TCP port")
    if isinstance(request_tokens, bool) or not isinstance(request_tokens, int) or request_tokens < 0:
        raise PlanError(f"request tokens: {request_tokens!r} is not a token count (0: not known)")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise PlanError(f"sglang_server_dp_size: {dp_size!r} is not a replica count (1 or more)")
    extra_args = [str(a) for a in (extra_args or [])]
    config = read_model_config(model_path)
    text = text_config(config)
    num_layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    try:
        aux = check_aux_layers(list(aux_layers), num_layers) if aux_layers else default_aux_layers(num_layers)
    except ValueError as exc:
        raise PlanError(f"sglang_server_aux_layers: {exc}") from exc
    if engine == "reference":
        if tp_size != 1:
            raise PlanError("sglang_server_tp_size: the reference engine runs on one device; set it to 1")
        argv = reference_argv(python, model_path, host, port, aux, capture_dir, device, api_key, extra_args, purpose,
                              dp_size, request_tokens)
        if purpose == "capture":
            expected = {
                "engine": "reference",
                "model_path": model_path,
                "disable_radix_cache": True,
                "chunked_prefill_size": -1,
                "enable_return_aux_hidden_states": True,
                "aux_layers": aux,
                "dp_size": dp_size,
            }
        else:
            expected = {"engine": "reference", "model_path": model_path, "enable_return_aux_hidden_states": False,
                        "capture_dir": None, "dp_size": dp_size}
        secret_format = "env" if api_key else None
    else:
        from eagle3_pipeline.serve import sglang_command  # noqa: PLC0415 - only for the sglang engine

        model_type = config.get("model_type") or text.get("model_type")
        if purpose == "serve":
            try:
                argv = sglang_command.serve_launch_argv(python, model_path, host, port, tp_size, extra_args,
                                                        api_key_file) + sglang_command.dp_args(dp_size)
            except ValueError as exc:
                raise PlanError(f"sglang_server_extra_args: {exc}") from exc
            expected = {**sglang_command.expected_serve_server_info(model_path, port, tp_size), "dp_size": dp_size}
            return _plan(engine, purpose, argv, api_key_file, "sglang_config" if api_key else None, expected, aux,
                         num_layers, hidden)
        try:
            sglang_command.check_extra_args(extra_args)
        except ValueError as exc:
            raise PlanError(f"sglang_server_extra_args: {exc}") from exc
        try:
            argv = sglang_command.launch_argv(
                python, model_path, host, port, tp_size, aux, capture_dir, model_type=model_type,
                extra_args=extra_args, api_key_config=api_key_file, num_hidden_layers=num_layers,
            ) + sglang_command.dp_args(dp_size)
            expected = {**sglang_command.expected_server_info(
                model_path, port, tp_size, aux, capture_dir, model_type=model_type, num_hidden_layers=num_layers
            ), "dp_size": dp_size}
        except ValueError as exc:
            raise PlanError(f"sglang_server_aux_layers: {exc}") from exc
        secret_format = "sglang_config" if api_key else None
    return _plan(engine, purpose, argv, api_key_file, secret_format, expected, aux, num_layers, hidden)


def _plan(engine: str, purpose: str, argv: list[str], api_key_file: str | None, secret_format: str | None,
          expected: dict, aux: list[int], num_layers: int, hidden: int) -> dict:
    capture = purpose == "capture"
    return {
        "engine": engine,
        "purpose": purpose,
        "argv": argv,
        "secret_format": secret_format,
        "api_key_file": api_key_file,
        "expected_server_info": expected,
        "aux_layers": aux if capture else [],
        "num_layers": num_layers,
        "hidden_size": hidden,
        "num_aux": len(aux) if capture else 0,
        "probe_input_ids": PROBE_INPUT_IDS if capture else [],  # a serving server writes no capture to probe
    }


def secret_text(secret_format: str, api_key: str) -> str:
    """The API key file's content: an env file line, or SGLang's --config YAML."""
    if not api_key or "\n" in api_key:
        raise PlanError("sglang_server_api_key must be a non-empty single line")
    if secret_format == "env":
        return f"{API_KEY_ENV}={api_key}\n"
    if secret_format == "sglang_config":
        from eagle3_pipeline.serve.sglang_command import api_key_config_text  # noqa: PLC0415

        return api_key_config_text(api_key)
    raise PlanError(f"unknown secret format {secret_format!r}")


def write_secret(path: str, secret_format: str, api_key: str) -> bool:
    """Write the key file (mode 0600, atomically); return whether its content changed."""
    text = secret_text(secret_format, api_key)
    target = Path(path)
    if target.exists() and target.read_text() == text and (target.stat().st_mode & 0o777) == 0o600:
        return False
    atomic_write_text(target, text, mode=0o600)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3_pipeline.serve.plan --json ...``: print the plan, or the error and exit 2."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["write-secret"]:
        return _write_secret_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--model-path", type=path_str, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--capture-dir", default="", help="where captures go (capture purpose only)")
    parser.add_argument("--purpose", default="capture", choices=PURPOSES,
                        help="capture (the extraction's server) or serve (answers only, no capture)")
    parser.add_argument("--aux-layers", default="", help="comma-separated 0-based layers; empty: the default")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1, help="SGLang replicas, one per GPU group (data parallel)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--api-key-file", default="", help="where the role writes the API key; empty: no key")
    parser.add_argument("--extra-args-json", default="[]", help="JSON list of extra arguments")
    parser.add_argument("--request-tokens", type=int, default=0,
                        help="the most tokens one request to a serving server holds, prompt and new tokens (the "
                        "regeneration's max length + max new tokens); the reference engine's slots are sized to it")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (the only output format)")
    args = parser.parse_args(argv)
    try:
        aux = [int(x) for x in args.aux_layers.split(",") if x.strip()]
        extra = json.loads(args.extra_args_json)
        if not isinstance(extra, list):
            raise PlanError("sglang_server_extra_args must be a list of strings, one argument each")
        if args.purpose == "capture" and not args.capture_dir:
            raise PlanError("sglang_server_capture_dir: a capture server needs a capture directory")
        plan = server_plan(args.engine, args.python, args.model_path, args.host, args.port, args.capture_dir,
                           aux, args.tp_size, args.device, args.api_key_file or None, extra, args.purpose,
                           args.dp_size, args.request_tokens)
    except (PlanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan, sort_keys=True))
    return 0


def _write_secret_main(argv: list[str]) -> int:
    """``plan write-secret --path P --format F``: the key comes on standard input, never argv."""
    parser = argparse.ArgumentParser(prog="plan write-secret")
    parser.add_argument("--path", required=True)
    parser.add_argument("--format", required=True, choices=["env", "sglang_config"])
    args = parser.parse_args(argv)
    try:
        changed = write_secret(args.path, args.format, sys.stdin.read().strip("\n"))
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"changed": changed, "path": args.path}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
