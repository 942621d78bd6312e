"""What a new user meets first, on a real `serve.py`: launch errors are one or two lines with
exit code 2 and no traceback; --help lists the groups a user picks; on a running server the
model id rule, the ready line, the favicon, the chat page's sampling default and the log line
of a refused request."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

from pipeserve.core.config import SchedulerConfig

from pipeserve.errors import ConfigError
from pipeserve.launch.overrides import expand_home
from pipeserve.model.tiny.text import ensure_model
from pipeserve.model.loader import locate
from tests.conftest import make_config, pinned, startup_error
from tests.doc_blocks import code_chunks, pages

ROOT = Path(__file__).resolve().parent.parent.parent


def _launch(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *overrides,
                             f"hydra.run.dir={tmp_path / 'run'}",
                             f"model.cache_dir={tmp_path / 'models'}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _keys(schema: type) -> str:
    """The keys a group's error lists: its schema's fields, as the user may set them."""
    return ", ".join(sorted(f.name for f in dataclasses.fields(schema)
                            if not f.name.startswith("_")))


def test_launch_errors_are_short_and_share_one_exit_code(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {   # overrides → what the one line must say (the problem and the fix)
            ("model.path=/nonexistent/model",):
                "model.path '/nonexistent/model' does not exist; point it at a model directory",
            ("scheduler.max_batchh=4",):
                "unknown config key 'scheduler.max_batchh' (did you mean scheduler.max_batch?); "
                f"'scheduler' has: {_keys(SchedulerConfig)}",
            ("kv=turb",): "kv=turb is not an option of kv (did you mean kv=turbo?); options: dense",
            ("model.path=/models/a(b)",):   # Hydra's grammar: the character and the quoting fix
                "model.path=/models/a(b): Hydra's override grammar cannot read '(' in an unquoted "
                "value; quote the value (with the shell's quotes around it): "
                "\"model.path='/models/a(b)'\"",
            ("model=tiny", f"server.port={port}"):
                f"server.port {port} on 127.0.0.1 is already in use",
            ("model.path=${oc.env:PIPESERVE_NOT_SET_X}",):   # OmegaConf's error, on one line
                "Environment variable 'PIPESERVE_NOT_SET_X' not found\"; full_key: model.name",
        }
        procs = {args: _launch(tmp_path / str(i), *args) for i, args in enumerate(cases)}
        outputs = {args: (p.wait(60), *p.communicate()) for args, p in procs.items()}
    for args, (rc, out, err) in outputs.items():
        lines = [line for line in (out + err).splitlines() if line.strip()]
        assert rc == 2, (args, out, err)
        assert len(lines) <= 2 and "Traceback" not in out + err, (args, out + err)
        assert cases[args] in err, (args, err)
        assert "huggingface-cli" not in err and "+scheduler" not in err
    assert not (tmp_path / "4" / "models").exists(), "a model was generated before the port check"


@pytest.mark.parametrize("path, message", [
    ("Org/not-downloaded-9z", "is not a local path and not in the local Hugging Face cache "
     "(pipeserve never downloads); download it first: `hf download Org/not-downloaded-9z`"),
    ("./no/such/dir", "does not exist; point it at a model directory"),
    ("{tmp}", "has no config.json; point it at a model directory"),
    ("{tmp}/x.bin", "is a file but not a GGUF file"),
])
def test_model_path_is_checked_before_anything_loads(tmp_path: Path, path: str, message: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """serve.py runs this check (pipeserve/model/loader.py: locate) right after the config, so each of
    these is the one-line launch error of the test above."""
    (tmp_path / "x.bin").write_bytes(b"not a gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = make_config(f"model.path={path.replace('{tmp}', str(tmp_path))}")
    with pytest.raises(ConfigError) as e:
        locate(cfg.model)
    assert message in str(e.value)


def test_paths_as_a_shell_user_types_them(server_factory: Any, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.path=~/models/X` unquoted (bash leaves a `~` after `=` alone and Hydra's grammar
    rejects it): the launch reads `~` as the home directory, for the model, the SSD cache
    directory and a pool's model directory alike."""
    home = tmp_path / "home"
    model = ensure_model(cache_dir=home / "models")
    monkeypatch.setenv("HOME", str(home))
    one = server_factory(f"model.path=~/models/{model.name}", "cache=ssd",
                         "cache.ssd.dir=~/prompt-cache", wait=False)
    pool = server_factory("pool=dir", "pool.model_dir=~/models", wait=False)
    one.wait_ready()
    pool.wait_ready()
    client = openai.OpenAI(base_url=one.base_url + "/v1", api_key="x")
    reply = client.chat.completions.create(model=model.name, max_tokens=4, messages=[
        {"role": "user", "content": "hi"}])
    assert reply.model == model.name and reply.choices[0].message.content
    assert (home / "prompt-cache").is_dir() and not (ROOT / "~").exists()
    served = openai.OpenAI(base_url=pool.base_url + "/v1", api_key="x").models.list()
    assert model.name in [m.id for m in served.data]


def test_home_is_expanded_only_in_path_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    monkeypatch.setenv("HOME", "/home/a b,c'd")   # Hydra would split on ',' and stop at "'"
    args = ["model.path=~/m", "+pool.models.x.path=~", "server.api_key_file=~/k",
            "model.chat_template=~/t.jinja", "server.api_key=~secret", "~model.adapter_dir",
            "--cfg", "server.port=8080"]
    out = expand_home(args)
    parser = OverridesParser.create()
    values = [parser.parse_override(a).value() for a in out[:4]]
    assert values == ["/home/a b,c'd/m", "/home/a b,c'd", "/home/a b,c'd/k",
                      "/home/a b,c'd/t.jinja"]
    assert out[4:] == args[4:]   # a key's value, a deletion, a flag: as typed
    sweep = parser.parse_override(expand_home(["model.path=~/a,~/b"])[0]).value()   # bench -m
    assert [x.text for x in sweep.list] == ["/home/a b,c'd/a", "/home/a b,c'd/b"]


def _broken_model_files(tmp: Path) -> dict[str, str]:
    """Damaged GGUF files (written by llama.cpp's `gguf` package, then cut or overwritten) and
    damaged safetensors checkpoints → what the launch's one line must say of each."""
    from gguf import GGMLQuantizationType as T

    from tests.model.test_gguf import _small, save_ggml_gguf, tokenizer_metadata

    tensors, meta = _small(tokenizer_metadata())
    whole = save_ggml_gguf(tmp / "whole.gguf", {n: (w, T.F32) for n, w in tensors.items()}, meta)
    data = whole.read_bytes()
    cut = len(data) - 4096
    at = data.index(b"llama.block_count") - 8   # that key's 8-byte length
    name = data.index(b"output_norm.weight") + len(b"output_norm.weight")
    ttype = name + 4 + 8 * int.from_bytes(data[name:name + 4], "little")   # after ndim, dims
    files = {
        "cut-in-tensors.gguf": (data[:cut], f"is truncated at byte {cut} of "),
        "cut-in-header.gguf": (data[:300], "is truncated at byte 300, inside its GGUF header"),
        "bad-length.gguf": (data[:at] + b"\xff" * 8 + data[at + 8:],
                            "is corrupt: its GGUF header does not parse (a string of "
                            f"{2**64 - 1} bytes runs past the end of the file"),
        "bad-type.gguf": (data[:ttype] + (200).to_bytes(4, "little") + data[ttype + 4:],
                          "tensor type unknown type 200 is not supported"),
    }
    out = {}
    for fname, (blob, message) in files.items():
        (tmp / fname).write_bytes(blob)
        out[str(tmp / fname)] = message
    falcon = save_ggml_gguf(tmp / "falcon.gguf", {n: (w, T.F32) for n, w in tensors.items()},
                            meta, arch="falcon")
    out[str(falcon)] = "GGUF architecture 'falcon' is not supported; supported: llama"
    model = ensure_model(cache_dir=tmp / "models")
    weights = (model / "model.safetensors").read_bytes()
    for dname, blob, message in [
            ("cut-checkpoint", weights[:len(weights) // 2],
             f"model.safetensors is truncated at byte {len(weights) // 2} of {len(weights)}"),
            ("bad-checkpoint", b"\xff" * 8 + weights[8:],
             "model.safetensors is corrupt (header too large")]:
        shutil.copytree(model, tmp / dname)
        (tmp / dname / "model.safetensors").write_bytes(blob)
        out[str(tmp / dname)] = message
    return out


def test_a_broken_model_file_is_one_line_naming_it_and_the_fix(tmp_path: Path) -> None:
    cases = _broken_model_files(tmp_path)
    procs = {path: _launch(tmp_path / str(i), f"model.path={path}", "server.port=0")
             for i, path in enumerate(cases)}
    for path, p in procs.items():   # seven launches at once: generous for a loaded machine
        out, err = p.communicate(timeout=600)
        rc = p.returncode
        assert rc == 2 and "Traceback" not in out + err, (path, rc, out, err)
        assert err.count("\n") == 1 and err.startswith(f"pipeserve: config error: model.path "
                                                         f"'{path}"), (path, err)
        assert cases[path] in err, (path, err)
        assert "download" in err or "supported:" in err, err   # the fix


LAUNCH = re.compile(r"(?:^|&& |; |\$ )(?:pipeserve|python serve\.py) +(.*)$")
ERROR_EXAMPLES = {"kv=turb", "scheduler.max_batchh=4", "model.path=/data/run=3/model"}


def launch_args(line: str) -> list[str] | None:
    """A `pipeserve ...` / `python serve.py ...` line's overrides; None for any other line and
    for one with placeholders (`...`, `<dir>`) or flags."""
    m = LAUNCH.search(line.strip())
    if not m:
        return None
    args = shlex.split(re.sub(r"\s+#.*$", "", m.group(1)))
    if args[:1] == ["fit"]:   # `pipeserve fit` takes the overrides a launch takes
        args = args[1:]
    if not args or any("..." in a or "<" in a or a.startswith("-") for a in args):
        return None
    return args


def documented_launches() -> list[tuple[str, list[str]]]:
    """Every launch in the README's and docs' code (inline spans, fenced and indented blocks),
    as its arguments."""
    found = []
    for page in pages():
        for chunk in code_chunks(page):
            for line in chunk.replace("\\\n", " ").splitlines():
                args = launch_args(line)
                if args is not None:
                    found.append((f"{page.name}: {line.strip()}", args))
    return found


def test_every_documented_launch_composes_as_bash_passes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a newcomer copies into bash gets past Hydra's grammar and the config checks (the
    weights are not here: a missing model.path is the one-line launch error tested above); the
    documented error examples fail with one line instead."""
    from hydra import compose, initialize_config_dir

    from pipeserve.config import check_overrides, load_config
    from pipeserve.launch.checks import _unparsable

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PIPESERVE_API_KEY", "k" * 32)
    launches = documented_launches()
    assert len(launches) >= 40 and any("model.path=~/" in w for w, _ in launches)
    seen = set()
    with initialize_config_dir(config_dir=str(ROOT / "pipeserve" / "conf"), version_base="1.3"):
        for where, args in launches:   # a key file the docs name (/etc/...) is not here
            args = expand_home([a for a in args if not a.startswith("server.admin_key_file=")])
            if tuple(args) in seen:
                continue
            seen.add(tuple(args))
            try:
                check_overrides(args)
                load_config(compose("serve", overrides=pinned(args)))
            except OverrideParseException as e:   # serve.py's one line for it
                assert " ".join(args) in ERROR_EXAMPLES, (where, _unparsable(e.override, str(e)))
            except (ConfigError, ConfigCompositionException, MissingConfigException) as e:
                assert " ".join(args) in ERROR_EXAMPLES, (where, str(e))
            else:
                assert " ".join(args) not in ERROR_EXAMPLES, where


def test_a_launch_on_a_terminal_says_it_is_starting_before_the_imports(tmp_path: Path) -> None:
    """On a terminal the first words come before seconds of imports and config checks (here
    the launch then fails: its one error line follows); piped, stdout stays the log alone."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "model.path=/nonexistent/m",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, stdout=slave,
                            stderr=slave, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(slave)
    out = b""
    for _ in range(10_000):   # until the process closes its end (EIO), bounded
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(60) == 2
    lines = [x for x in out.decode().splitlines() if x.strip()]
    assert lines[0].startswith("pipeserve: starting: config, then MLX and the server, then the "
                               "model"), lines
    assert lines[-1].startswith("pipeserve: config error: model.path '/nonexistent/m' does not "
                                "exist"), lines


def _read_pty(master: int, proc: subprocess.Popen, until: str) -> str:
    """What the process writes to its terminal, until `until` shows or it exits (bounded)."""
    import select

    out = b""
    for _ in range(3000):   # 0.2 s each: ten minutes at most
        if until.encode() in out:
            break
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # the process closed its end
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out.decode(errors="replace")


def test_a_launch_on_a_terminal_shows_its_long_steps_on_one_line(tmp_path: Path) -> None:
    """A GGUF's first launch converts it, reads the weights and (asked for here; on by default
    on a GPU) warms the kernels up: on a terminal each step is one line redrawn in place
    (carriage returns, never a line per update) and cleared before the step's log line; the
    server then comes up as usual."""
    import pty
    import signal

    from gguf import GGMLQuantizationType as T

    from tests.model.test_gguf import _small, save_ggml_gguf, tokenizer_metadata

    tensors, meta = _small(tokenizer_metadata())
    model = save_ggml_gguf(tmp_path / "small.gguf", {n: (w, T.F32) for n, w in tensors.items()},
                           meta)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), f"model.path={model}",
                             "server.port=0", "scheduler.kernel_warmup=true",
                             f"model.cache_dir={tmp_path / 'cache'}",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, stdout=slave,
                            stderr=slave, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(slave)
    try:
        out = _read_pty(master, proc, "ready: model")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        os.close(master)
    assert "ready: model small" in out, out
    for step, done in [("converting small.gguf", "converting small.gguf: "),
                       ("loading small: reading the weights", "loading small [5/5]"),
                       ("kernel warm-up", "kernel warm-up: ")]:
        drawn = re.findall(rf"\r{re.escape(step)} \[[#.]{{20}}\] +(\d+)% ", out)
        assert drawn and drawn[-1] == "100", (step, out)
        # the full bar, cleared, then log lines only: the step's own where the bar was (or
        # after whole lines another part logged meanwhile, e.g. Sanic's "Worker ready")
        if not re.search(rf"\r{re.escape(step)} \[#{{20}}\] 100% \([^\r\n]*\r\x1b\[K"
                         rf"(?:\[[^\r\n]*\r?\n)*\[[^\n]*{re.escape(done)}", out):
            at = out.rfind(f"\r{step} [")   # what followed the step's last bar, untruncated
            pytest.fail(f"{step}: not cleared before its log line; after its last bar:\n"
                        f"{out[at:at + 1500]!r}")


def test_help_lists_the_groups_a_user_picks_and_not_internal_ones() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    groups = dict(re.findall(r"^  (\w+) +(.+)$", done.stdout, re.M))
    assert {"model", "kv", "draft", "cache", "scheduler", "admission"} <= set(groups)
    assert "turbo" in groups["kv"] and "dense*" in groups["kv"]   # the default is marked
    assert not {"hydra", "schema", "bench", "job_logging"} & set(groups)
    assert "schema/" not in done.stdout and "hydra/" not in done.stdout


@pytest.fixture(scope="module")
def tiny_server(server_factory: Any) -> Any:
    return server_factory()


def _greedy(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0)
    return r.choices[0].message.content


def test_one_model_id_rule(tiny_server: Any) -> None:
    """A single-model server answers any model name with its one model (clients hard-code
    names); `<id>:<tag>` names adapter <tag>, and `:latest` (Ollama's tag) is the model."""
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x")
    base = _greedy(client, "tiny")
    for name in ("gpt-4o", "qwen2.5:7b", "tiny:latest"):
        assert _greedy(client, name) == base, name
    with pytest.raises(openai.NotFoundError) as e:
        _greedy(client, "tiny:legal")
    assert "adapter 'legal', which is not mounted" in e.value.body["message"]


def test_ready_line_log_lines_favicon_and_page_default(tiny_server: Any) -> None:
    url = tiny_server.base_url
    log = tiny_server.log()
    assert f"chat page {url}/" in log
    assert re.search(r"loading tiny \[1/\d\] (generated|found generated) /", log), log
    icon = httpx.get(url + "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    page = httpx.get(url + "/").text
    box = re.search(r'<input id="temperature"[^>]*>', page).group(0)
    assert "value=" not in box   # blank: the request leaves temperature to the server's default
    assert 'href="/favicon.svg"' in page
    bad = httpx.post(url + "/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3})
    assert bad.status_code == 400
    reason = bad.json()["error"]["message"]
    line = [x for x in tiny_server.log().splitlines() if "outcome=invalid" in x][-1]
    assert "status=400" in line and json.dumps(reason)[1:-1][:40] in line, line


def test_a_directory_mlx_lm_cannot_load_is_a_config_error(tmp_path: Path,
                                                          model_cache: Path) -> None:
    """A config.json without weights gets past the launch check; the load then fails as a
    ConfigError (serve.py's one-line report, exit 2) naming model.path and the fix."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    message = startup_error(model_cache, f"model.path={tmp_path}")
    assert message.startswith(f"model.path '{tmp_path}' cannot be loaded by mlx-lm: "), message
    assert "point it at an MLX checkpoint" in message
