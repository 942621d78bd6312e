"""The `server` group's schema: listening, keys, bodies, streams and stored responses of the HTTP
side. Imports no mlx: checked at launch."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
import re
from typing import Optional

from pipeserve.errors import ConfigError, check_positive as _positive


# The spans removed by default: per-request metadata a client writes into the prompt, never an
# instruction to the model. Claude Code (2.1.36 on) sends `x-anthropic-billing-header:
# cc_version=...; cc_entrypoint=cli; cch=<random>;` as its first system block.
VOLATILE_SPANS = {"claude_code_billing": r"(?m)^x-anthropic-billing-header:[^\n]*(?:\n|$)"}


class LogFormat(Enum):
    text = "text"
    json = "json"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"   # address to listen on; 0.0.0.0 for every interface
    port: int = 8080          # TCP port to listen on
    # connections the kernel completes before the server accepts them (listen backlog; the
    # kernel caps it at net.core.somaxconn): a burst of new clients beyond it while the event
    # loop is busy has its connects dropped and retried a second later
    backlog: int = 2048
    api_key: Optional[str] = None     # when set, requests need `Authorization: Bearer <key>`
    admin_key: Optional[str] = None   # guards /admin/* when set
    api_key_file: Optional[str] = None    # read api_key from this file at launch (stripped)
    admin_key_file: Optional[str] = None  # read admin_key from this file at launch (stripped)
    metrics_auth: bool = False        # /metrics needs admin_key (api_key when no admin_key)
    max_body_mb: float = 16.0         # request bodies above this get 413
    shutdown_timeout_s: float = 120.0  # how long SIGTERM waits for active requests
    cors_origins: list[str] = field(default_factory=list)  # Access-Control-Allow-Origin values
    log_format: LogFormat = LogFormat.text   # text lines, or one JSON object per line
    keep_alive_s: float = 15.0        # seconds between SSE keep-alive comments while queued
    responses_ttl_s: float = 3600.0   # how long /v1/responses keeps a stored response
    responses_store_mb: float = 64.0  # byte cap of stored responses (decimal MB; 0 = store none)
    stream_resume_s: float = 60.0     # an SSE stream stays resumable (GET /v1/streams/{id}) this
    #                                   long after it ends; a resumable one outlives its client so long
    stream_resume_mb: float = 64.0    # byte cap of the frames kept for resumes (decimal MB)
    chat_page: bool = True            # GET / serves the browser chat page (pipeserve/http/static/chat.html)
    allow_request_templates: bool = False  # accept chat_template_kwargs.chat_template (sandboxed)
    # a request field the endpoint does not implement is a 400 naming it; false: it is ignored,
    # named in the x-pipeserve-ignored header and counted (pipeserve/http/api/known_fields.py)
    strict_fields: bool = False
    request_template_timeout_s: float = 2.0  # wall-clock seconds a request's template may render
    # how long a Python thread holds the GIL while another waits for it (sys.setswitchinterval):
    # the engine thread builds each step's graph while the event loop writes every stream's
    # tokens; a shorter slice keeps the engine from waiting out the loop's
    switch_interval_ms: float = 5.0
    # log each time the event loop, or every Python thread (a C call holding the GIL), went this
    # long without running, with where each thread was (pipeserve/launch/stalls.py); 0: off
    stall_report_ms: float = 0.0
    # a log handler whose reader falls behind (stdout a pipe nobody drains) gets its lines
    # from a thread of its own, so the event loop and the engine never wait on it: this many
    # records wait for it, then new ones are dropped and counted
    # (pipeserve_log_records_dropped_total) until it reads again
    log_buffer_records: int = 10_000
    # MLX's CUDA graphs (MLX_USE_CUDA_GRAPHS, set before MLX is imported; children inherit it).
    # None: as the environment sets it, MLX's default (on) otherwise. On, one stream decodes
    # ~20% faster (its steps' launches are the bound); off, batched steps run 0-6% faster and a
    # burst of a batch shape the process has not met costs 2-31 ms more than the next, against
    # 14-72 ms on. Measured: docs/notes/2026-12-06-round16.md. No effect on the CPU
    cuda_graphs: Optional[bool] = None
    # each engine in its own child process (the parent keeps HTTP, tokenize, admission and
    # detokenize); None: on for a pool, off for a single model (pipeserve/pool/)
    isolate: Optional[bool] = None
    # one model on a thread of the server (isolate unset or false): an engine that dies while
    # serving (its loop raised; a CUDA context left unusable) fails what is in flight with 503
    # and the server exits with status 70, for a supervisor (systemd, Docker, k8s) to start it
    # again; false: it stays up answering 503. An engine in its own process (isolate, a pool)
    # exits 70 the same way, whatever this says, and the server restarts it
    exit_on_engine_death: bool = True
    # per-request noise removed from a chat's messages before tokenize, so a session's turns
    # share their prefix in the prompt cache: name → regular expression (null turns them off;
    # pipeserve/http/api/volatile.py)
    volatile_spans: Optional[dict[str, str]] = field(default_factory=lambda: dict(VOLATILE_SPANS))
    # /v1/files and /v1/batches: the uploaded and produced files and each batch's state live
    # here, so a batch goes on after a restart (pipeserve/http/batch/); so do background
    # responses (responses/: pipeserve/http/api/background_store.py)
    files_dir: str = "~/.cache/pipeserve/files"
    files_max_mb: float = 200.0   # one uploaded file's size cap (decimal MB); more is a 413
    batch_concurrency: int = 2    # batch lines in flight at once, over every batch
    # a running background response's output token ids are written to disk every this many
    # tokens (and when it ends or the server stops), so a restart resumes it from there
    background_checkpoint_tokens: int = 256

    def __post_init__(self) -> None:
        for name, pattern in (self.volatile_spans or {}).items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"server.volatile_spans.{name} is not a regular expression "
                                  f"({e}): {pattern!r}") from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        _positive("server.responses_ttl_s", self.responses_ttl_s, allow_none=False)
        _positive("server.switch_interval_ms", self.switch_interval_ms, allow_none=False)
        _positive("server.stream_resume_s", self.stream_resume_s, allow_none=False)
        _positive("server.stream_resume_mb", self.stream_resume_mb, allow_none=False)
        if self.responses_store_mb < 0:
            raise ConfigError(
                f"server.responses_store_mb must be >= 0, got {self.responses_store_mb}")
        _positive("server.max_body_mb", self.max_body_mb, allow_none=False)
        _positive("server.files_max_mb", self.files_max_mb, allow_none=False)
        if self.stall_report_ms < 0:
            raise ConfigError(f"server.stall_report_ms must be >= 0 (0: off), got "
                              f"{self.stall_report_ms}")
        if self.log_buffer_records < 1:
            raise ConfigError(f"server.log_buffer_records must be >= 1, got "
                              f"{self.log_buffer_records}")
        if self.backlog < 1:
            raise ConfigError(f"server.backlog must be >= 1, got {self.backlog}")
        if self.background_checkpoint_tokens < 1:
            raise ConfigError(f"server.background_checkpoint_tokens must be >= 1, got "
                              f"{self.background_checkpoint_tokens}")
        if self.batch_concurrency < 1:
            raise ConfigError(f"server.batch_concurrency must be >= 1, got "
                              f"{self.batch_concurrency}")
        _positive("server.shutdown_timeout_s", self.shutdown_timeout_s, allow_none=False)
        _positive("server.keep_alive_s", self.keep_alive_s, allow_none=False)
        _positive("server.request_template_timeout_s", self.request_template_timeout_s,
                  allow_none=False)
        self.api_key = _read_key("api_key", self.api_key, self.api_key_file)
        self.admin_key = _read_key("admin_key", self.admin_key, self.admin_key_file)
        if self.metrics_auth and not (self.admin_key or self.api_key):
            raise ConfigError("server.metrics_auth=true needs server.admin_key or server.api_key "
                              "(or their _file forms): /metrics would have no key to check")


# Server fields that hold or locate a key: never hashed, never written literally to run files.
SECRET_FIELDS = ("api_key", "admin_key", "api_key_file", "admin_key_file")


def _read_key(name: str, value: Optional[str], path: Optional[str]) -> Optional[str]:
    """server.<name>, or the stripped contents of server.<name>_file (read at launch)."""
    if value is not None and path is not None:
        raise ConfigError(f"server.{name} and server.{name}_file are both set; set one")
    if path is not None:
        file = Path(path).expanduser()
        try:
            value = file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"server.{name}_file {str(file)!r} cannot be read: "
                              f"{e.strerror or e}") from e
        if not value:
            raise ConfigError(f"server.{name}_file {str(file)!r} is empty")
    elif value is not None and not value.strip():
        raise ConfigError(f"server.{name} is empty; unset it to serve without a key")
    return value
