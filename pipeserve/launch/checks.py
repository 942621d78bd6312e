"""What a launch checks before any model loads, and how a launch error reads: one or two lines
naming the problem and the fix, exit code 2 (LAUNCH_ERROR) for every one of them. Also the
`--help` text. Main thread, before and around Hydra's main; never imports MLX."""
from __future__ import annotations

import difflib
import errno
import socket
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeserve.http.config import SECRET_FIELDS
from pipeserve.errors import ConfigError
from pipeserve.launch.overrides import grammar_message

LAUNCH_ERROR = 2   # every launch error: bad config, model not found, port in use, load failed
ENGINE_DIED = 70   # EX_SOFTWARE: the engine died while serving (server.exit_on_engine_death)
HIDDEN_GROUPS = {"hydra", "bench", "schema"}   # Hydra's own, bench.py's, the schema store


def conf_dir() -> Path:
    """pipeserve/conf/: package data, at the same place in a checkout, an editable and a plain
    install."""
    here = Path(__file__).resolve().parent.parent / "conf"
    if not (here / "serve.yaml").is_file():
        raise ConfigError(f"pipeserve's config directory {here} is missing; reinstall pipeserve")
    return here


def fail(message: str) -> None:
    """Print a launch error (no traceback) and exit with LAUNCH_ERROR."""
    print(f"pipeserve: {one_line(message)}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(LAUNCH_ERROR)


def one_line(message: str) -> str:
    """A launch error on one line: OmegaConf's multi-line errors joined with '; ', without its
    reference_type / object_type lines (the key is already named)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()
             and not line.strip().startswith(("reference_type=", "object_type="))]
    return "; ".join(lines)


def groups(conf: Path) -> dict[str, list[str]]:
    """Config group → its options, as the CLI selects them (`kv=turbo`)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(conf.iterdir()) if d.is_dir() and d.name not in HIDDEN_GROUPS
            and any(d.glob("*.yaml"))}


def help_text(conf: Path) -> str:
    defaults = {}
    for item in OmegaConf.load(conf / "serve.yaml").get("defaults", []):
        if isinstance(item, DictConfig):
            for k, v in item.items():
                if "/" not in str(k) and not str(k).startswith("override"):
                    defaults[str(k)] = v
    lines = ["pipeserve: an LLM inference server (OpenAI and Anthropic APIs) on MLX.", "",
             "usage: pipeserve [group=option ...] [key=value ...]",
             "       (or: python serve.py ..., the same arguments)", "",
             "examples:",
             "  pipeserve                                  # SmolLM2-135M demo model on 127.0.0.1:8080",
             "  pipeserve model.path=~/models/Qwen3-8B-4bit  # a local MLX checkpoint",
             "  pipeserve model.path=~/models/q.gguf server.port=9000",
             "  pipeserve model=qwen kv=turbo draft=mtp",
             "  pipeserve model=tiny                       # generated random weights, no download",
             "  pipeserve fit model.path=~/models/q.gguf   # will it fit? the estimate, no load",
             "  (~ in a path value is your home directory; a value with ( ) [ ] { } = , or quotes",
             "   needs quoting: \"model.path='/data/run=3/model'\")",
             "", "config groups (group=option; default marked *):"]
    for group, options in groups(conf).items():
        default = defaults.get(group)
        shown = [f"{o}*" if o == default else o for o in options]
        lines.append(f"  {group:<13} {', '.join(shown)}")
    lines += ["", "every key of a group: pipeserve --cfg job (prints the composed config);",
              "docs/configuration.md lists each key with its type, default and meaning.",
              "Hydra's own flags (multirun, shell completion): pipeserve --hydra-help"]
    return "\n".join(lines)


def check_overrides_compose(conf: Path, overrides: list[str]) -> None:
    """Compose the launch's overrides once, before Hydra's main does, so that a typo reads as
    one line with what is valid instead of Hydra's `use +key=value` hint."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException, OverrideParseException

    mine = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            try:
                compose("serve", overrides=mine)
            except MissingConfigException as e:
                raise ConfigError(_missing_option(str(e), overrides)) from None
            except OverrideParseException as e:
                raise ConfigError(_unparsable(e.override or "", str(e))) from None
            except Exception as e:   # Hydra's ConfigCompositionException and OmegaConf's errors
                raise ConfigError(_bad_override(e, mine, compose)) from None
    finally:
        GlobalHydra.instance().clear()


def _missing_option(msg: str, overrides: list[str]) -> str:
    first = msg.splitlines()[0]
    options = [line.strip() for line in msg.splitlines() if line.startswith("\t")
               and "provider=" not in line]
    if "Could not find '" in first:
        wanted = first.split("Could not find '", 1)[1].split("'", 1)[0]
        group, _, option = wanted.rpartition("/")
        close = difflib.get_close_matches(option, options, 1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        return (f"{group}={option} is not an option of {group}{hint}; "
                f"options: {', '.join(options)}")
    return first


def _unparsable(override: str, error: str) -> str:
    key = override.partition("=")[0]
    if any(name in key for name in SECRET_FIELDS):   # never echo a key's value
        return (f"{key}: Hydra's override grammar cannot read its value; quote the value "
                f"(with the shell's quotes around it): \"{key}='...'\"")
    return grammar_message(override, error)


def _bad_override(e: Exception, overrides: list[str], compose: object) -> str:
    msg = str(e).splitlines()[0]
    cause = e.__cause__ or e
    detail = str(cause).splitlines()[0]
    if msg.startswith("Could not override '"):
        key = msg.split("'", 2)[1]
        rest = [o for o in overrides if o.partition("=")[0].lstrip("+~") != key]
        try:
            cfg = compose("serve", overrides=rest)   # type: ignore[operator]
        except Exception:   # the other overrides fail too: report this one only
            return f"unknown config key '{key}': {detail}"
        parts = key.split(".")
        depth = 0   # the longest prefix of the key that exists
        while depth < len(parts) - 1 and isinstance(
                OmegaConf.select(cfg, ".".join(parts[:depth + 1])), DictConfig):
            depth += 1
        parent, leaf = ".".join(parts[:depth]), parts[depth]
        node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = sorted(str(k) for k in node.keys() if not str(k).startswith("_"))
        close = difflib.get_close_matches(leaf, keys, 1)
        hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
        where = f"'{parent}'" if parent else "the root config"
        return f"unknown config key '{key}'{hint}; {where} has: {', '.join(keys)}"
    if msg.startswith("Error merging override"):
        key = msg.removeprefix("Error merging override ").partition("=")[0]
        if any(name in key for name in SECRET_FIELDS):   # never echo a key's value
            return f"{key}: its value cannot be used ({type(cause).__name__})"
        return f"{key}: {detail}"
    return f"{msg}: {detail}" if detail != msg else msg


def chat_url(host: str, port: int) -> str:
    """The chat page's address as a browser on this machine reaches it."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/"


def check_port(host: str, port: int) -> None:
    """Refuse, before the model loads, a port another process listens on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(port_message(host, port, e)) from None


def port_message(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (f"server.port {port} on {host} is already in use (another server is listening "
                f"there); stop it or pick another port: server.port={port + 1}")
    if e.errno == errno.EACCES:
        return (f"server.port {port} on {host} needs privileges this user lacks; "
                "pick a port above 1023: server.port=8080")
    return f"cannot listen on {host}:{port} (server.host, server.port): {e.strerror or e}"
