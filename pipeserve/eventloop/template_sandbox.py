"""A chat template sent by a client (`chat_template_kwargs.chat_template`, only with
server.allow_request_templates) renders in a child process: Jinja's immutable sandbox with the
globals Hugging Face templates use, a CPU-time alarm, an address-space cap and an output cap inside,
and a kill from the parent past the wall-clock bound. A thread could not be stopped (nested loops
or `"x" * 10**9` run on, holding the GIL); a process can. Parent side: any thread but the loop.
This file is also the child's program (stdlib + jinja2 only: it starts in a fraction of a second)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

MEMORY_BYTES = 1 << 30      # the child's address-space cap: a template cannot balloon the host
STARTUP_S = 10.0            # how long the child may take to start (a loaded host); not rendering
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # as transformers aliases them


class TemplateRejected(Exception):
    """The template did not compile, failed, ran too long or wrote too much; `str()` says which."""


def render(template: str, context: dict[str, Any], timeout_s: float, max_chars: int) -> str:
    """`template` rendered with `context` (messages, tools, special tokens, kwargs). Blocks the
    calling thread for at most about `timeout_s` plus the child's start."""
    job = {"template": template, "context": context, "timeout_s": timeout_s, "max_chars": max_chars}
    payload = json.dumps(job, ensure_ascii=False).encode("utf-8", "surrogatepass")
    # an empty environment: nothing of the server's (keys included) is in the child's reach
    proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={})
    try:
        assert proc.stdout is not None
        ready = (select.select([proc.stdout], [], [], STARTUP_S)[0]
                 and os.read(proc.stdout.fileno(), 1) == b"r")
        if not ready:
            raise TemplateRejected(f"could not be rendered: the sandbox did not start within "
                                   f"{STARTUP_S:g} s")
        t0 = time.perf_counter()
        # the child's timer stops Python code at timeout_s; this stops it stuck in one C call
        out, _ = proc.communicate(payload, timeout=timeout_s + 1)
    except subprocess.TimeoutExpired as e:
        raise TemplateRejected(f"did not finish rendering within {timeout_s:g} s "
                               "(server.request_template_timeout_s); it was stopped") from e
    finally:
        if proc.poll() is None:
            proc.kill()   # our own child, by its handle
        proc.wait()
    head, _, body = out.partition(b"\n")
    if head == b"ok":
        return body.decode("utf-8", "surrogatepass")
    if head == b"error":
        raise TemplateRejected(body.decode("utf-8", "replace"))
    raise TemplateRejected(f"ended after {time.perf_counter() - t0:.1f} s without a result "
                           f"(status {proc.returncode}: past the sandbox's CPU or "
                           f"{MEMORY_BYTES >> 20} MiB memory limit)")


# -- the child -----------------------------------------------------------------------------
def _environment() -> Any:
    """Jinja's ImmutableSandboxedEnvironment, set up as transformers sets it up for templates."""
    from datetime import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}` (assistant-mask markup): renders its body."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:   # noqa: N805 (Jinja's own signature)
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a namespace cannot hold underscore-prefixed attributes, got {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace, dict=dict,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _alias_reasoning(messages: list[Any]) -> list[Any]:
    out = []
    for m in messages:
        if isinstance(m, dict):
            r = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
            if r is not None:
                m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


def _render_child(job: dict[str, Any]) -> str:
    import jinja2

    ctx, cap = job["context"], job["max_chars"]
    ctx["messages"] = _alias_reasoning(ctx.get("messages") or [])
    try:
        template = _environment().from_string(job["template"])
    except jinja2.TemplateSyntaxError as e:
        raise TemplateRejected(f"does not compile: {e.message} (line {e.lineno})") from e
    parts, size = [], 0
    for piece in template.generate(**ctx):
        parts.append(piece)
        size += len(piece)
        if size > cap:
            raise TemplateRejected(f"renders to more than {cap} characters, more than the "
                                   "context can hold")
    return "".join(parts)


def _child() -> None:
    import resource
    import signal

    import jinja2

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))   # writes no file
    _environment()   # imports and sets up Jinja before the parent's clock starts
    sys.stdout.buffer.write(b"r")
    sys.stdout.buffer.flush()
    job = json.loads(sys.stdin.buffer.read().decode("utf-8", "surrogatepass"))
    timeout_s = float(job["timeout_s"])
    # CPU past the timer (stuck in one C call the alarm cannot interrupt): SIGXCPU ends it
    cpu = int(timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            text = _render_child(job)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        head, body = b"ok", text.encode("utf-8", "surrogatepass")
    except TimeoutError:
        head, body = b"error", (f"did not finish rendering within {timeout_s:g} s "
                                "(server.request_template_timeout_s)").encode()
    except TemplateRejected as e:
        head, body = b"error", str(e).encode()
    except OverflowError as e:   # the sandbox's range cap (MAX_RANGE) and int overflow
        head, body = b"error", f"exceeds a sandbox limit: {e}".encode()
    except jinja2.exceptions.SecurityError as e:
        head, body = b"error", f"does something the sandbox forbids: {e}".encode()
    except MemoryError:
        head, body = b"error", (f"needs more than {MEMORY_BYTES >> 20} MiB to render").encode()
    except Exception as e:   # the template's own failure (raise_exception, undefined, type errors)
        head, body = b"error", f"failed: {type(e).__name__}: {str(e)[:300]}".encode()
    sys.stdout.buffer.write(head + b"\n" + body)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _child()
