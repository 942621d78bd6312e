"""Log formatters for Hydra's job_logging config (pipeserve/conf/hydra/job_logging/pipeserve.yaml):
`server.log_format` picks text lines or one JSON object per line. Any thread."""
from __future__ import annotations

import json
import logging
import time
from typing import Any

TEXT_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, msg, the record's `extra`
    fields, and exc (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
                               "logger": record.name, "msg": record.getMessage()}
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def formatter(log_format: Any = "text") -> logging.Formatter:
    """The formatter `server.log_format` names: "text" or "json" (a str or the LogFormat enum,
    as Hydra's resolved config hands it over)."""
    name = getattr(log_format, "value", log_format)
    return JsonFormatter() if name == "json" else logging.Formatter(TEXT_FORMAT)
