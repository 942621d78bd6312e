"""SsdStore: prompt-cache entries on disk (diskcache), keyed under an identity directory
(model fingerprint, KV scheme and compute dtype, MLX version and device, tokenizer, adapters)
so incompatible state never loads. A writer thread does every disk write; lookups read on
the engine thread. Survives restarts: the token index is rebuilt from disk at start."""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Any

import diskcache

from pipeserve.metrics import Metrics
from pipeserve.prompt_cache.codec import CorruptEntry, Staged, decode
from pipeserve.prompt_cache.keys import TRIE_KEY, GhostIndex
from pipeserve.prompt_cache.trie import TokenTrie

log = logging.getLogger(__name__)


def token_key(tokens: tuple[int, ...], model: str = TRIE_KEY) -> str:
    """The disk key of an entry: its tokens, and its adapter's trie root unless the launch
    default's (model_key), so entries of two adapters never share a key."""
    text = repr(tokens) if model == TRIE_KEY else model + "|" + repr(tokens)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _stored_key(value: Any) -> tuple[str, tuple[int, ...]] | None:
    """(trie root, tokens) of a `t:` record: a token list (the launch default's) or
    {"model": root, "tokens": [...]} (another adapter's)."""
    if isinstance(value, dict):
        value, model = value.get("tokens"), value.get("model")
    else:
        model = TRIE_KEY
    if isinstance(model, str) and isinstance(value, (list, tuple)) and value:
        return model, tuple(value)
    return None


NOTE = "pipeserve-note.json"   # in each namespace: what its identity hash stands for


class SsdStore:
    tier = "ssd"

    def __init__(self, root: Path, identity: str, max_bytes: int, verify: bool,
                 metrics: Metrics) -> None:
        self.dir = root / identity
        self.verify = verify
        self.metrics = metrics
        limit = max_bytes if max_bytes > 0 else 1 << 62
        self.disk = diskcache.Cache(str(self.dir), size_limit=limit,
                                    eviction_policy="least-recently-stored")
        self.trie = TokenTrie()
        self.index: dict[tuple[str, tuple[int, ...]], str] = {}   # (root, tokens) -> key
        for key in list(self.disk.iterkeys()):
            if isinstance(key, str) and key.startswith("t:"):
                stored = _stored_key(self.disk.get(key))
                if stored is not None:
                    self._index(stored[1], stored[0])
        self.foreign = GhostIndex(limit=2048)   # keys written under other identities
        others = [p for p in root.iterdir() if p.is_dir() and p.name != identity] \
            if root.exists() else []
        for other in others:
            self._remember_foreign(other)
        if others:
            log.info("prompt cache: %d SSD namespaces of other models/settings left untouched",
                     len(others))
        self._queue: queue.Queue[Any] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pipeserve-ssd-writer",
                                        daemon=True)
        self._writer.start()
        self._report()

    def _remember_foreign(self, path: Path) -> None:
        """Token keys of another identity's entries: a miss they explain is `incompatible`."""
        try:
            with diskcache.Cache(str(path)) as other:
                for key in other.iterkeys():
                    if isinstance(key, str) and key.startswith("t:"):
                        stored = _stored_key(other.get(key))
                        if stored is not None:
                            self.foreign.add(stored[1], stored[0], path.name)
        except (OSError, sqlite3.Error, pickle.UnpicklingError, EOFError, ValueError) as e:
            # not a diskcache of ours (another tool's or an old format's directory)
            log.info("prompt cache: skipped SSD namespace %s (%s)", path.name, e)

    def write_note(self, note: dict[str, Any]) -> None:
        """What this namespace's identity hash stands for, in clear (`kv`: the KV scheme), so
        a server under another identity can say why these entries do not fit it."""
        try:
            (self.dir / NOTE).write_text(json.dumps(note))
        except OSError as e:
            log.info("prompt cache: cannot write the namespace note (%s)", e)

    def namespace_note(self, name: str) -> dict[str, Any]:
        try:
            note = json.loads((self.dir.parent / name / NOTE).read_text())
        except (OSError, ValueError):
            return {}
        return note if isinstance(note, dict) else {}

    def _index(self, tokens: tuple[int, ...], model: str = TRIE_KEY) -> None:
        self.index[(model, tokens)] = token_key(tokens, model)
        self.trie.add(model, list(tokens), tokens)

    # -- engine thread --------------------------------------------------------------
    def best(self, prompt_ids: list[int], trimmable: bool, model: str = TRIE_KEY
             ) -> tuple[tuple[int, ...], int] | None:
        """The stored entry (of trie root `model`) reusing the most of `prompt_ids[:-1]`,
        and how many tokens."""
        limit = len(prompt_ids) - 1
        if limit < 1 or not self.index:
            return None
        query = list(prompt_ids[:limit])
        found = self.trie.search(model, query)
        if found.exact is not None:
            return tuple(query), limit
        best = None
        if found.shorter is not None:
            best = (tuple(found.shorter), len(found.shorter))
        if (trimmable and found.longer is not None
                and found.common_prefix > (best[1] if best else 0)):
            best = (tuple(found.longer), found.common_prefix)
        return best

    def load(self, tokens: tuple[int, ...], model: str = TRIE_KEY) -> list[Any] | None:
        """Read and check an entry; a missing, corrupt or truncated one is removed, counted
        and never served."""
        key = token_key(tokens, model)
        blob = self.disk.get("e:" + key)
        if blob is None:
            self._forget(tokens, model)
            return None
        try:
            stored, caches = decode(blob, self.verify)
            if tuple(stored) != tokens:
                raise CorruptEntry("tokens do not match the key")
        except CorruptEntry as e:
            log.warning("prompt cache: dropping corrupt SSD entry %s (%s)", key, e)
            self.metrics.cache_corrupt.inc()
            self.disk.delete("e:" + key)
            self.disk.delete("t:" + key)
            self._forget(tokens, model)
            return None
        self.metrics.cache_restores.inc()
        return caches

    def _forget(self, tokens: tuple[int, ...], model: str = TRIE_KEY) -> None:
        if self.index.pop((model, tokens), None) is not None:
            self.trie.pop(model, list(tokens))
        self._report()

    def submit(self, tokens: tuple[int, ...], blob: bytes | Staged, model: str = TRIE_KEY) -> None:
        """Queue an entry for the writer: bytes, or a Staged entry whose host copy the writer
        makes (the engine never waits for the disk, nor for the copy)."""
        if (model, tokens) not in self.index:
            self._index(tokens, model)
        self._queue.put((tokens, blob, model))
        self.metrics.cache_write_queue.set(self._queue.qsize())

    def put_raw(self, key: str, value: Any) -> None:
        """Queue any picklable value (a checkpoint) for the writer under `key`."""
        self._queue.put(("raw", key, value))

    def delete_raw(self, key: str) -> None:
        self._queue.put(("delete", key, None))

    def get_raw(self, key: str) -> Any:
        return self.disk.get(key)

    def drained(self) -> threading.Event:
        """An event set once everything queued so far is on disk."""
        done = threading.Event()
        self._queue.put(done)
        return done

    # -- writer thread ---------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if len(item) == 3 and isinstance(item[0], str):
                op, key, value = item
                if op == "raw":
                    if isinstance(value, dict) and isinstance(value.get("kv"), Staged):
                        value = {**value, "kv": value["kv"].bytes()}   # host copy here
                    self.disk.set(key, value)
                else:
                    self.disk.delete(key)
                continue
            self.metrics.cache_write_queue.set(self._queue.qsize())
            tokens, blob, model = item
            if isinstance(blob, Staged):   # the host copy and hashing happen here
                blob = blob.bytes()
            key = token_key(tokens, model)
            record: Any = (list(tokens) if model == TRIE_KEY
                           else {"model": model, "tokens": list(tokens)})
            try:
                self.disk.set("e:" + key, blob)
                self.disk.set("t:" + key, record)   # index after data: never dangles
                self.metrics.cache_ssd_writes.inc()
                self.metrics.cache_ssd_write_bytes.inc(len(blob))
            except OSError:
                log.exception("prompt cache: SSD write of %s failed", key)
            self._report()

    def _report(self) -> None:
        self.metrics.cache_entries.labels(self.tier).set(len(self.index))
        self.metrics.cache_bytes.labels(self.tier).set(self.disk.volume())

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(30)
        self.disk.close()
