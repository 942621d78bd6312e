"""RowStore: the one owner of every running row's KV, whatever its phase or batch shape —
a row's own per-layer caches (prefill, prompt-cache hits), a group of rows prefilled together
in one batched cache, or the decode batch (one batched cache per layer, rows in order, with
each row's next input token). Rows are request ids; this module knows no request state.
Merging, extending, filtering, padding and a verify step's rollback live here (the replay a
recurrent layout needs runs through the forward the store is built with). Engine thread only."""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from pipeserve.core.plan import PlannedRow
from pipeserve.kv import padded
from pipeserve.kv.padded import (LeftPaddedBatch, finalize, note_padding, note_right_padding,
                                  noted_padding)
from pipeserve.kv.rotating import is_rotating, rewind_rotating, rewind_rotating_rows
from pipeserve.prompt_cache.protocol import Block, SharedKVCache, reserve

Replay = Callable[[list[PlannedRow], "RowStore"], Any]   # Forward.feed: rows feed host tokens


@dataclass(eq=False)
class _Group:
    """Rows prefilled together, or parked together out of the decode batch: one batched cache
    per layer whose rows are `ids`, in order. They join the decode batch together (no extract +
    merge). A None id is a dead slot: a row that stayed in the decode batch when the others
    left it (its KV there is a copy); the first filter of the group drops it."""

    ids: list[str | None]
    caches: list[Any]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The decode batch's recurrent state before a verify forward (rebinding keeps the old
    arrays alive: a zero-copy snapshot), and the rows it covers."""

    ids: tuple[str, ...]
    layers: tuple[tuple[int, list[Any], Any, Any], ...]


class RowStore:
    """Rows join the decode batch after their prefill (own caches are merged in, a prefill
    group is extended in whole) and leave when released (filtered out). A lone decode row keeps
    plain per-row caches (`solo`): no padding mask, the exact arithmetic of mlx-lm; the batch
    converts when a second row joins and back when it drains to one. `replay` is the forward
    a rollback replays kept tokens through (recurrent layers); a store that never rolls back a
    recurrent batch needs none."""

    def __init__(self, make_cache: Callable[[], list[Any]], replay: Replay | None = None) -> None:
        self.make_cache = make_cache
        self.replay = replay
        self._verify: tuple[int, Snapshot | None] | None = None   # (width, state) of a verify
        self._own: dict[str, list[Any]] = {}
        self._lent: set[str] = set()   # own caches adopted from a hit, not yet fed to a forward
        self._groups: dict[str, _Group] = {}
        self._rows: list[str] = []            # the decode batch, in row order
        self._caches: list[Any] | None = None  # one cache per layer (batched unless solo)
        self._next: mx.array | None = None     # (len(rows),) each row's next input token
        self.solo = False

    # -- where a row's KV is ------------------------------------------------------------
    def __contains__(self, rid: str) -> bool:
        return rid in self._own or rid in self._groups or rid in self._rows

    def _where(self, rid: str) -> int | None:
        """The row's place in the decode batch (one scan, no index built), or None."""
        try:
            return self._rows.index(rid)
        except ValueError:
            return None

    @property
    def num_rows(self) -> int:
        """Rows whose KV the store holds, in any home."""
        return len(set(self._own) | set(self._groups) | set(self._rows))

    @property
    def decode_rows(self) -> list[str]:
        return list(self._rows)

    def adopt(self, rid: str, caches: list[Any]) -> None:
        """The row's KV arrives from elsewhere (a prompt-cache hit): views of buffers the
        lender keeps, until the row's first forward writes its own."""
        self.release(rid)
        self._own[rid] = caches
        self._lent.add(rid)

    def sole(self, rid: str) -> bool:
        """Whether `caches_of(rid)` gives the row's live caches over buffers no one else
        holds: its own (written by a forward since any hit lent it views) or the lone decode
        row's. A finished row's such buffers can become a prompt-cache entry as they are."""
        if rid in self._own:
            return rid not in self._lent
        return self.solo and self._rows == [rid]

    def own(self, rid: str, until: int = 0) -> list[Any]:
        """The row's own caches (a new row gets empty ones); it must not be batched. `until`:
        where the caller's write ends; a hit's lent plain caches too short for it are first
        rebuilt with room up to the 256-token step past it (one copy of the prefix; growing
        an exact-size view costs that copy plus a zeroed tail, at a size no cold row has)."""
        assert rid not in self._rows, rid
        self._ungroup(rid)
        caches = self._own.get(rid)
        if caches is None:
            caches = self._own[rid] = self.make_cache()
        elif rid in self._lent and any(type(c) is KVCache and c.keys is not None
                                       and c.keys.shape[2] < until for c in caches):
            caches = self._own[rid] = reserve(caches, -(-(until + 1) // 256) * 256)
        self._lent.discard(rid)   # the caller feeds them (the forward writes the row's own)
        return caches

    def mergeable(self, rid: str) -> bool:
        """Whether the row's own KV may join a padded group forward: none yet, or plain
        attention caches (a prompt-cache hit's prefix)."""
        g = self._groups.get(rid)
        if g is not None:   # parked in a group: its extracted row is plain where the layers are
            return all(type(c) is BatchKVCache for c in g.caches)
        caches = self._own.get(rid)
        return caches is None or all(type(c) is KVCache for c in caches)

    def take_own(self, rids: Sequence[str]) -> list[list[Any]]:
        """The rows' own caches, handed over (for a grouped prefill: `group` gives them back)."""
        self._lent.difference_update(rids)
        for r in rids:
            self._ungroup(r)
        return [self._own.pop(r, None) or self.make_cache() for r in rids]

    def _ungroup(self, rid: str) -> None:
        """A row parked in a group that is to be fed on its own (a drafter's row catching up
        by prompt chunks) gets its KV as its own caches (a copy); its slot becomes dead."""
        g = self._groups.pop(rid, None)
        if g is None:
            return
        i = g.ids.index(rid)
        self._own[rid] = extract_rows(g.caches, [i])[0]
        g.ids[i] = None

    def group(self, rids: Sequence[str | None], caches: list[Any]) -> None:
        """These rows now live in one batched cache per layer (rows in `rids` order; None: a
        dead slot)."""
        g = _Group(list(rids), caches)
        for r in rids:
            if r is not None:
                self._groups[r] = g

    def caches_of(self, rid: str) -> list[Any] | None:
        """This row's per-layer caches: its own (live), or extracted from a group or the batch
        (copies); None when the store holds nothing for it."""
        if rid in self._own:
            return self._own[rid]
        g = self._groups.get(rid)
        if g is not None:
            return extract_rows(g.caches, [g.ids.index(rid)])[0]
        where = self._where(rid)
        if where is None:
            return None
        if self.solo:
            return self._caches
        return extract_rows(self._caches, [where])[0]

    def entry_bytes(self, rid: str, tokens: int) -> int | None:
        """What a copy of the batched row's first `tokens` positions would take (`copy_of`'s
        size, from the layers' shapes: nothing is read or made); None where copy_of gives
        none."""
        caches = self._batched_caches(rid)
        if caches is None:
            return None
        return tokens * sum(c.keys.shape[1] * c.keys.shape[3] * c.keys.itemsize
                            + c.values.shape[1] * c.values.shape[3] * c.values.itemsize
                            for c in caches)

    def _batched_caches(self, rid: str) -> list[Any] | None:
        """The batched caches holding row `rid` where every layer is plain batched attention
        (what copy_of copies from); None for any other row or layout."""
        g = self._groups.get(rid)
        if g is not None:
            caches = g.caches
        elif self.solo or rid not in self._rows:
            return None
        else:
            caches = self._caches
        ok = all(type(c) is BatchKVCache and c.keys is not None for c in caches)
        return caches if ok else None

    def copy_of(self, rid: str, upto: int) -> list[Any] | None:
        """A copy of the batched row's first `upto` positions that only the caller holds, at
        exactly that size (a prompt-cache entry keeps it as it is: no second copy), where every
        layer is a plain batched attention cache; None for a row with caches of its own, the
        lone decode row or another layout (the caller copies from `caches_of`)."""
        return self.copies_of({rid: upto}).get(rid)

    def copies_of(self, wanted: dict[str, int]) -> dict[str, list[Any]]:
        """`copy_of` for many rows (row id → positions): the rows of one batch are copied
        with its padding read once (each read waits for the device and gives the GIL up). Rows
        `copy_of` would answer None for are left out."""
        by_batch: dict[int, tuple[list[Any], list[tuple[str, int, int]]]] = {}
        for rid, upto in wanted.items():
            caches = self._batched_caches(rid)
            if caches is None:
                continue
            g = self._groups.get(rid)
            i = g.ids.index(rid) if g is not None else self._rows.index(rid)
            by_batch.setdefault(id(caches), (caches, []))[1].append((rid, i, upto))
        out: dict[str, list[Any]] = {}
        for caches, rows in by_batch.values():
            pads = host_padding(caches)
            copies = (shared_rows(caches, [(i, u) for _, i, u in rows], pads) if len(rows) > 1
                      else None)
            if copies is None:
                copies = extract_rows(caches, [i for _, i, _ in rows], [u for _, _, u in rows],
                                      pads=pads)
            for (rid, _, upto), copy in zip(rows, copies):
                if all(c.offset == upto for c in copy):   # the row holds fewer: none
                    out[rid] = copy
        return out

    def layer_of(self, rid: str, layer: int) -> Any | None:
        """One layer of this row's caches, as `caches_of` gives them (a copy of only that
        layer when the row is batched); None when the store holds nothing for it."""
        if rid in self._own:
            return self._own[rid][layer]
        g = self._groups.get(rid)
        if g is not None:
            return g.caches[layer].extract(g.ids.index(rid))
        where = self._where(rid)
        if where is None:
            return None
        return self._caches[layer] if self.solo else self._caches[layer].extract(where)

    # -- the decode batch -------------------------------------------------------------
    def decode_batch(self, rids: Sequence[str], known: dict[str, int | None]
                     ) -> tuple[list[Any], list[str], mx.array]:
        """Make the batch hold exactly `rids`: continuing rows keep their order, the rest are
        dropped (their KV kept as their own caches), newcomers join at the end with their
        input from `known` (host tokens). Returns (caches, row order, next-input tokens)."""
        self._verify = None   # a forward follows: an earlier verify's state is stale
        wanted = set(rids)
        keep = [i for i, r in enumerate(self._rows) if r in wanted]
        if len(keep) != len(self._rows):
            self._filter(keep, park=True)
        present = set(self._rows)
        joiners = [r for r in rids if r not in present]
        if joiners:
            self._extend(joiners, known)
        assert self._caches is not None and self._next is not None
        return self._caches, list(self._rows), self._next

    def park(self, rids: Sequence[str]) -> None:
        """These rows leave the decode batch, keeping their KV as their own caches."""
        leaving = set(rids)
        if leaving & set(self._rows):
            self._filter([i for i, r in enumerate(self._rows) if r not in leaving], park=True)

    def set_next(self, order: Sequence[str], tokens: mx.array) -> None:
        """The tokens the batch's rows feed next (sampled or emitted), in `order`."""
        if list(order) == self._rows:
            self._next = tokens
            return
        where = {r: i for i, r in enumerate(order)}
        idx = mx.array([where[r] for r in self._rows], dtype=mx.int32)
        self._next = tokens[idx]

    def _filter(self, keep: list[int], park: bool = False) -> None:
        """Keep the batch rows at `keep`; with `park`, rows that leave keep their KV as
        their own caches (a row that stops decoding for a step without finishing)."""
        kept = set(keep)
        leaving = [i for i in range(len(self._rows)) if i not in kept]
        pads = None if self.solo else host_padding(self._caches)   # one read serves all below
        if park and not self.solo and all(_rebinds(c) for c in self._caches):
            self._park_group(keep, leaving, pads)
        elif park:
            parked = (extract_rows(self._caches, leaving, pads=pads) if not self.solo
                      else [list(self._caches)] * len(leaving))
            for i, caches in zip(leaving, parked):
                self._own[self._rows[i]] = caches
            if not self.solo:   # copied now: a lazy copy would keep the whole old batch alive
                mx.async_eval([a for caches in parked for c in caches   # until it was read
                               for a in (getattr(c, "keys", None), getattr(c, "values", None))
                               if isinstance(a, mx.array)])
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._rows, self._caches, self._next, self.solo = [], None, None, False
            return
        idx = mx.array(keep, dtype=mx.int32)
        self._next = self._next[idx]
        if self.solo:
            return
        pads = filter_layers(self._caches, keep, idx, pads)
        if len(keep) == 1:
            self._caches = extract_rows(self._caches, [0], pads=pads)[0]
            self.solo = True

    def _park_group(self, keep: list[int], leaving: list[int],
                    pads: list[list[int] | None]) -> None:
        """Rows leaving the decode batch (all of a burst's rows whose last outputs are in
        flight, say) park as one group instead of a copy each (rows x layers slices, and the
        old batch alive beside the copies until they ran: twice a large batch's KV at once).
        When at least as many leave as stay, the group keeps the old batch itself (no copy:
        the staying rows become dead slots there until the group is next filtered) and the
        staying rows are gathered into a new batch; otherwise the leaving rows are gathered
        into the group, one gather a layer. `self._caches` is then filtered to `keep`."""
        old, rows = self._caches, self._rows
        assert old is not None
        if len(leaving) >= len(keep):
            kept = set(keep)
            self.group([r if i not in kept else None for i, r in enumerate(rows)], old)
            self._caches = [copy.copy(c) for c in old] if keep else old
            return
        parked = [copy.copy(c) for c in old]   # filters rebind: the batch's own stay as they are
        filter_layers(parked, leaving, mx.array(leaving, dtype=mx.int32), pads)
        # run now: a lazy gather would keep the whole old batch alive until it was read
        mx.async_eval([a for c in parked for a in _arrays(c)])
        self.group([rows[i] for i in leaving], parked)

    def _extend(self, joiners: list[str], known: dict[str, int | None]) -> None:
        if self._caches is None and len(joiners) == 1 and joiners[0] not in self._groups:
            self._caches, self.solo = self.own_or_new(joiners[0]), True
            self._own.pop(joiners[0], None)
            parts: list[tuple[list[str], list[Any] | None]] = [(joiners, None)]
        else:
            if self.solo:
                self._caches = [merge_layer([layer]) for layer in self._caches]
                self.solo = False
            parts = self._batched_parts(joiners)
        for ids, caches in parts:
            if caches is None:
                pass
            elif self._caches is None:
                self._caches = caches
            else:
                for mine, theirs in zip(self._caches, caches):
                    extend_layer(mine, theirs)
            self._rows.extend(ids)
        new = mx.array([known[r] for ids, _ in parts for r in ids], dtype=mx.uint32)
        self._next = new if self._next is None else mx.concatenate([self._next, new])

    def own_or_new(self, rid: str) -> list[Any]:
        self._lent.discard(rid)   # joining the decode batch: its forward follows
        return self._own.get(rid) or self.make_cache()

    def _batched_parts(self, joiners: list[str]) -> list[tuple[list[str], list[Any]]]:
        """Joiners as (rows, batched caches): rows with their own caches merged into one
        part, each prefill group's rows as another (filtered if some of them left)."""
        plain = [r for r in joiners if r not in self._groups]
        parts: list[tuple[list[str], list[Any]]] = []
        if plain:
            own = [self.own_or_new(r) for r in plain]
            for r in plain:
                self._own.pop(r, None)
            parts.append((plain, [merge_layer(list(layer)) for layer in zip(*own)]))
        joining = set(joiners)
        seen: set[int] = set()
        for r in joiners:
            g = self._groups.get(r)
            if g is None or id(g) in seen:
                continue
            seen.add(id(g))
            keep = [i for i, m in enumerate(g.ids) if m in joining]
            if len(keep) != len(g.ids):   # members not joining now keep their KV as their own
                pads = host_padding(g.caches)
                others = [i for i, m in enumerate(g.ids) if m is not None and m not in joining]
                for i, caches in zip(others, extract_rows(g.caches, others, pads=pads)):
                    self._own[g.ids[i]] = caches
                filter_layers(g.caches, keep, mx.array(keep, dtype=mx.int32), pads)
            for m in g.ids:
                if m is not None:
                    self._groups.pop(m, None)
            parts.append(([g.ids[i] for i in keep], g.caches))
        return parts

    # -- rollback, memory, release ------------------------------------------------------
    def snapshot(self) -> Snapshot | None:
        """What a verify rollback needs for state that cannot be trimmed (recurrent layers)."""
        if self._caches is None:
            return None
        saved = tuple((i, list(c.cache), getattr(c, "lengths", None),
                       getattr(c, "left_padding", None))
                      for i, c in enumerate(self._caches)
                      if not (c.is_trimmable() or is_rotating(c)))
        return Snapshot(tuple(self._rows), saved) if saved else None

    def restore(self, snap: Snapshot, drop: int = 0) -> None:
        """Put the recurrent layers back as `snap` saw them; with `drop`, also cut the last
        `drop` positions of every row's trimmable layers (what was fed since, the same for
        every row)."""
        assert snap.ids == tuple(self._rows) and self._caches is not None
        for i, state, lengths, left in snap.layers:
            c = self._caches[i]
            c.cache = state
            c.lengths, c.left_padding = lengths, left
        if drop:
            for c in self._caches:
                if is_rotating(c):
                    rewind(c, [drop] * len(self._rows), self.solo)
                elif c.is_trimmable():
                    c.trim(drop)

    def before_verify(self, width: int) -> None:
        """The decode batch is about to feed `width` positions per row (its input, then its
        drafts, right-padded): keep what `rollback` needs — the recurrent layers' state (a
        zero-copy snapshot) and the width."""
        self._verify = (width, self.snapshot())

    def rollback(self, rows: Sequence[PlannedRow], kept: Mapping[str, int]) -> None:
        """After that verify forward: keep, per decode row, the KV of its input and its first
        `kept[rid]` drafts and drop the rest. Attention-only: each row's surplus is trimmed (a
        batched row's becomes left padding). With recurrent layers their state goes back to the
        snapshot, every trimmable layer drops the whole width, and each row's input + kept
        drafts are fed again through `replay`. `rows` are the plan's decode rows (any order)."""
        held, self._verify = self._verify, None
        assert held is not None and self._caches is not None, "rollback without a verify"
        width, snap = held
        drop = [width - 1 - kept[rid] for rid in self._rows]
        if not any(drop):
            return
        if snap is None:
            self.trim_decode(drop)
            return
        assert self.replay is not None, "a recurrent rollback needs the store's replay forward"
        self.restore(snap, drop=width)
        by_id = {r.request_id: r for r in rows}
        again = [replace(by_id[rid], num_tokens=1, drafts=by_id[rid].drafts[:kept[rid]])
                 for rid in self._rows]
        self.replay(again, self)
        mx.eval([c.state for c in self._caches])

    def trim_own(self, rid: str, n: int) -> None:
        """Drop the last `n` positions of the row's own caches (a draft head's speculative
        entries)."""
        for c in self._own.get(rid, ()):
            c.trim(n)

    def trim_decode(self, drop: Sequence[int]) -> None:
        """Drop the last `drop[i]` positions of decode row i (rejected drafts): a batched
        row's surplus becomes left padding."""
        if not any(drop) or self._caches is None:
            return
        if self.solo:
            for c in self._caches:
                if is_rotating(c):
                    rewind(c, drop, solo=True)
                else:
                    c.trim(drop[0])
            return
        trim_rows(self._caches, list(drop))
        drop_shared_padding(self._caches, len(drop))

    def release(self, rid: str) -> None:
        """The row finished: free its KV wherever it is."""
        self.release_many([rid])

    def release_many(self, rids: Sequence[str]) -> None:
        """These rows finished: free their KV wherever it is. The decode batch is filtered
        once for all of them (each filter copies the batch's KV and reads its padding back)."""
        gone = set(rids)
        shrunk: dict[int, _Group] = {}
        for rid in rids:
            self._own.pop(rid, None)
            self._lent.discard(rid)
            g = self._groups.pop(rid, None)
            if g is not None:
                shrunk[id(g)] = g
        for g in shrunk.values():   # one filter a group, however many of its rows finished
            keep = [j for j, m in enumerate(g.ids) if m is not None and m not in gone]
            g.ids = [g.ids[j] for j in keep]
            if keep:
                filter_layers(g.caches, keep, mx.array(keep, dtype=mx.int32))
        keep = [i for i, r in enumerate(self._rows) if r not in gone]
        if len(keep) != len(self._rows):
            self._filter(keep)

    def drop_shared(self) -> list[str]:
        """After a failed step the shared KV (decode batch, prefill groups) cannot be trusted:
        drop it; returns the rows that lost their KV (rows with their own caches keep them)."""
        lost = list(self._rows) + list(self._groups)
        self._groups.clear()
        self._verify = None
        self._rows, self._caches, self._next, self.solo = [], None, None, False
        return lost

    @property
    def nbytes(self) -> int:
        held = sum(c.nbytes for c in self._caches) if self._caches else 0
        held += sum(c.nbytes for caches in self._own.values() for c in caches)
        groups = {id(g): g for g in self._groups.values()}
        return held + sum(c.nbytes for g in groups.values() for c in g.caches)


def _rebinds(layer: Any) -> bool:
    """Whether the layer's filter rebinds its arrays (never writes them in place), so that a
    shallow copy of it can be filtered apart from the original: plain batched attention and
    the quantized layouts' padded batch."""
    return (type(layer) is BatchKVCache and layer.keys is not None) or \
        isinstance(layer, LeftPaddedBatch)


def _arrays(layer: Any) -> list[mx.array]:
    out: list[mx.array] = []
    for name in ("keys", "values"):
        a = getattr(layer, name, None)
        out += [a] if isinstance(a, mx.array) else [x for x in a or () if isinstance(x, mx.array)]
    return out


def host_padding(caches: list[Any]) -> list[list[int] | None]:
    """Each layer's left padding per row (None: a layer without one): the host copy noted for
    a plain layer's array (`noted_padding`), else read from the device once for every layer
    left. A read waits for every step queued on the device (the drain copies while one is in
    flight), and each wait gives up the GIL, which an event loop busy streaming beside the
    engine thread may then keep for a whole switch interval; mlx-lm's extract and filter read
    it layer by layer. The lists are the notes themselves: read them, never change them."""
    out: list[list[int] | None] = []
    read: list[tuple[int, Any, list[int] | None]] = []
    for c in caches:
        pad = getattr(c, "left_padding", None)
        if not isinstance(pad, mx.array):
            out.append(pad or None)
            continue
        known = noted_padding(c)
        if known is None or padded.CHECK_PADDING:
            read.append((len(out), c, known))
        out.append(known)
    if read:
        mx.eval([c.left_padding for _, c, _ in read])   # the one wait
        for j, c, known in read:
            values = c.left_padding.tolist()   # a ready array's read keeps the GIL in practice
            if known is not None and known != values:
                raise AssertionError(f"noted left padding {known} is not the layer's {values}")
            out[j] = values
            note_padding(c, values)
    return out


def extract_rows(caches: list[Any], rows: list[int], upto: int | list[int] | None = None,
                 pads: list[list[int] | None] | None = None) -> list[list[Any]]:
    """Batch rows `rows` as caches of their own (copies), each a list over `caches`' layers;
    `upto`: only each row's first `upto` positions (plain batched layers; one for all rows, or
    one a row). A plain batched layer is sliced with its padding read once for all (`pads`,
    or `host_padding`); any other layout extracts its own way."""
    if not rows:
        return []
    uptos = upto if isinstance(upto, list) else [upto] * len(rows)
    plain = [type(c) is BatchKVCache and c.keys is not None for c in caches]
    padded = [isinstance(c, LeftPaddedBatch) for c in caches]
    if pads is None and (any(plain) or any(padded)):
        pads = host_padding(caches)
    out: list[list[Any]] = [[] for _ in rows]
    for layer, is_plain, is_padded, pad in zip(caches, plain, padded,
                                               pads or [None] * len(caches)):
        for row, i, up in zip(out, rows, uptos):
            if is_padded and pad is not None and up is None:   # a quantized layout's own
                row.append(layer.extract(i, pad[i]))
                continue
            if not is_plain or pad is None:
                row.append(layer.extract(i))
                continue
            start = pad[i]
            end = layer._idx if up is None else min(start + up, layer._idx)
            c = KVCache()
            c.keys = mx.contiguous(layer.keys[i:i + 1, :, start:end])
            c.values = mx.contiguous(layer.values[i:i + 1, :, start:end])
            c.offset = end - start
            row.append(c)
    return out


def shared_rows(caches: list[Any], rows: list[tuple[int, int]],
                pads: list[list[int] | None]) -> list[list[Any]] | None:
    """Batch rows (index, first positions kept) of plain batched layers copied with one
    gather a layer into a `Block` for all of them, each row's caches views of it (128 rows
    leaving a 36-layer batch: 72 copies, not 9,216); None (copy row by row) where a layer has
    no padding read or the rows' spans would leave more than an eighth of the block unused
    (rows of very different lengths)."""
    spans: list[list[tuple[int, int]]] = []
    for layer, pad in zip(caches, pads):
        if pad is None or type(layer) is not BatchKVCache or layer.keys is None:
            return None
        mine = [(pad[i], min(pad[i] + up, layer._idx)) for i, up in rows]
        lo, hi = min(a for a, _ in mine), max(b for _, b in mine)
        if 8 * sum(hi - lo - (b - a) for a, b in mine) > len(mine) * (hi - lo):
            return None
        spans.append(mine)
    idx = mx.array([i for i, _ in rows], dtype=mx.int32)
    out: list[list[Any]] = [[] for _ in rows]
    arrays: list[mx.array] = []
    for layer, mine in zip(caches, spans):
        lo, hi = min(a for a, _ in mine), max(b for _, b in mine)
        keys, values = layer.keys[:, :, lo:hi][idx], layer.values[:, :, lo:hi][idx]
        arrays += [keys, values]
        if all(span == (lo, hi) for span in mine):   # rows of one length: one split a layer
            ks, vs = mx.split(keys, len(rows), axis=0), mx.split(values, len(rows), axis=0)
        else:
            ks = [keys[j:j + 1, :, a - lo:b - lo] for j, (a, b) in enumerate(mine)]
            vs = [values[j:j + 1, :, a - lo:b - lo] for j, (a, b) in enumerate(mine)]
        for row, k, v, (a, b) in zip(out, ks, vs, mine):
            c = SharedKVCache()
            c.keys, c.values, c.offset = k, v, b - a
            row.append(c)
    block = Block(arrays, sum(a.nbytes for a in arrays))
    for row in out:
        for c in row:
            c.block = block
    return out


def filter_layers(caches: list[Any], keep: list[int], idx: mx.array,
                  pads: list[list[int] | None] | None = None) -> list[list[int] | None]:
    """Keep batch rows `keep` (`idx`, the same as an array) in every layer, dropping the
    padding they all share, as each layout's `filter` does; a plain batched layer does it
    with its padding read once for all (`pads`). Returns the padding left, per layer."""
    plain = [type(c) is BatchKVCache or isinstance(c, LeftPaddedBatch) for c in caches]
    if pads is None and any(plain):
        pads = host_padding(caches)
    left: list[list[int] | None] = []
    made: Made = {}
    for c, is_plain, pad in zip(caches, plain, pads or [None] * len(caches)):
        if not is_plain or pad is None:
            c.filter(idx)
            left.append(None)
            continue
        kept = [pad[i] for i in keep]
        shared = min(kept)
        if isinstance(c, LeftPaddedBatch):   # a quantized layout filters itself, told the padding
            c.filter(idx, kept)
            left.append([p - shared for p in kept])
            continue
        if c.keys is not None:
            c.keys, c.values = c.keys[idx], c.values[idx]
            if shared:
                c.keys, c.values = c.keys[..., shared:, :], c.values[..., shared:, :]
        c.offset = c.offset[idx]
        left.append([p - shared for p in kept])
        c.left_padding = padding_array(left[-1], made)
        c._idx -= shared
        note_padding(c, left[-1])
    return left


Made = dict[tuple[int, ...], mx.array]   # per-row int arrays made once for a call's layers


def padding_array(values: list[int], made: Made | None = None) -> mx.array:
    """mx.array(values) as an array object of its own; with `made`, a view of one array made
    once for every layer of a call: an array made from a Python list cost ~0.1 ms on CUDA
    (a group of 28 layers made 84), and a batch's layers share their padding. A view, never
    the shared object: mlx-lm's caches update theirs in place (`offset += n`)."""
    if made is None:
        return mx.array(values)
    key = tuple(values)
    base = made.get(key)
    if base is None:
        base = made[key] = mx.array(values)
    return base[...]


def batch_kv(left_padding: list[int], made: Made | None = None) -> BatchKVCache:
    """mlx-lm's `BatchKVCache(left_padding)`, its per-row arrays from `padding_array`
    (tests/core/test_padding_arrays.py holds it to the constructor's attributes)."""
    cache = BatchKVCache.__new__(BatchKVCache)
    cache.keys = cache.values = cache._right_padding = None
    cache.left_padding = padding_array(left_padding, made)
    cache.offset = padding_array([-p for p in left_padding], made)
    cache._idx = 0
    note_padding(cache, list(left_padding))
    return cache


def pad_left(caches: list[Any], padding: list[int], made: Made | None = None) -> None:
    """Every (empty) layer's `prepare(left_padding=padding)`; plain ones through
    `padding_array`."""
    for c in caches:
        if type(c) is BatchKVCache and c.keys is None:
            extra, known = padding_array(padding, made), noted_padding(c)
            c.left_padding, c.offset = c.left_padding + extra, c.offset - extra
            if known is not None:
                note_padding(c, [a + b for a, b in zip(known, padding)])
        else:
            c.prepare(left_padding=padding)


def pad_right(caches: list[Any], lengths: list[int], padding: list[int],
              made: Made | None = None) -> None:
    """Every layer's `prepare(lengths=..., right_padding=padding)` before a right-padded
    forward; plain ones through `padding_array`."""
    for c in caches:
        if type(c) is BatchKVCache:
            if max(padding) > 0:
                c._right_padding = padding_array(padding, made)
                note_right_padding(c, list(padding))
        else:
            c.prepare(lengths=lengths, right_padding=padding)


def merge_layer(layers: list[Any], room: int = 0, made: Made | None = None) -> Any:
    """Per-row caches of one layer → one batched cache (mlx-lm's merge classmethods). `room`:
    tokens each row writes next (a prefill group's chunk width); plain caches are merged into
    a buffer that already holds them, so that write lands in place instead of growing the
    batch by concatenation (a copy of every row). `made`: see `padding_array`."""
    plain = all(type(c) is KVCache for c in layers)
    if room and len(layers) > 1 and plain and any(c.keys is not None for c in layers):
        return _room_merge(layers, room, made)
    if len(layers) > 1 and plain and all(c.keys is not None for c in layers):
        return _concat_merge(layers, made)
    if plain and all(c.keys is None for c in layers):   # mlx-lm's merge of empty caches
        return batch_kv([0] * len(layers), made)
    merge = getattr(type(layers[0]), "merge", None)
    if merge is None:
        raise TypeError(f"{type(layers[0]).__name__} cannot join a shared decode batch")
    merged = merge(layers)
    if plain:   # mlx-lm's merge pads each row to the longest on the left
        longest = max(c.size() for c in layers)
        note_padding(merged, [longest - c.size() for c in layers])
    return merged


def _concat_merge(layers: list[KVCache], made: Made | None = None) -> BatchKVCache:
    """mlx-lm's BatchKVCache.merge of plain caches, as one concatenation: the same arrays
    (rows left-padded with zeros to the longest), one device operation a tensor instead of
    one slice update a row (128 rows joining at once: 72 kernels a step, not 9,216)."""
    longest = max(c.offset for c in layers)
    padding = [longest - c.offset for c in layers]

    def rows(name: str) -> mx.array:
        parts = []
        for c, pad in zip(layers, padding):
            a = getattr(c, name)
            a = a if a.shape[2] == c.offset else a[..., :c.offset, :]
            parts.append(mx.pad(a, [(0, 0), (0, 0), (pad, 0), (0, 0)]) if pad else a)
        return mx.concatenate(parts, axis=0)
    cache = batch_kv(padding, made)
    cache.keys, cache.values = rows("keys"), rows("values")
    cache.offset += longest
    cache._idx = longest
    return cache


def _room_merge(layers: list[KVCache], room: int, made: Made | None = None) -> BatchKVCache:
    """Plain caches (some may be empty) → one BatchKVCache whose buffer holds the longest row
    plus `room` rounded up to BatchKVCache.step, as its own growth would make it: each row's
    KV is copied once, straight from its buffers (a prompt-cache hit's lent views are only
    read), into a zeroed buffer that each row's slice update writes in place."""
    longest = max(c.offset if c.keys is not None else 0 for c in layers)
    padding = [longest - (c.offset if c.keys is not None else 0) for c in layers]
    step = BatchKVCache.step
    size = longest + -(-room // step) * step
    like = next(c for c in layers if c.keys is not None)
    cache = batch_kv(padding, made)
    for name in ("keys", "values"):
        a = getattr(like, name)
        buf = mx.zeros((len(layers), a.shape[1], size, a.shape[3]), a.dtype)
        for i, (c, pad) in enumerate(zip(layers, padding)):
            if c.keys is not None and c.offset:
                kv = getattr(c, name)
                buf[i:i + 1, :, pad:longest, :] = (kv if kv.shape[2] == c.offset
                                                   else kv[..., :c.offset, :])
        setattr(cache, name, buf)
    cache.offset += longest
    cache._idx = longest
    return cache


def extend_layer(mine: Any, theirs: Any) -> None:
    """`mine.extend(theirs)`; a plain layer's padding noted after it where both sides' were
    (mlx-lm's extend right-justifies both sides at the longer write position)."""
    a, b = noted_padding(mine), noted_padding(theirs)
    known = None
    if type(mine) is BatchKVCache and type(theirs) is BatchKVCache and None not in (a, b):
        if mine.keys is None and theirs.keys is None:
            known = a + b
        else:
            at = max(mine._idx, theirs._idx)
            known = [p + at - mine._idx for p in a] + [p + at - theirs._idx for p in b]
    mine.extend(theirs)
    note_padding(mine, known)


SHARED_PADDING_MAX = 16   # tokens of padding every row has before it is cut away


def drop_shared_padding(caches: list[Any], rows: int) -> None:
    """Rows that accept different numbers of drafts gain different left padding; once every
    row has some, the batch is wider than any row needs: cut the common part (the same as a
    filter that keeps every row)."""
    keep = None
    for c, pad in zip(caches, host_padding(caches)):
        if not pad or is_rotating(c):
            continue   # (a rotating buffer's padding leaves as it wraps)
        if min(pad) >= SHARED_PADDING_MAX:
            keep = mx.arange(rows) if keep is None else keep
            filter_layers([c], list(range(rows)), keep, [pad])


def rewind(cache: Any, drop: Sequence[int], solo: bool) -> None:
    """A sliding-window layer drops each row's last `drop[i]` positions
    (pipeserve/kv/rotating.py)."""
    if solo:
        rewind_rotating(cache, drop[0])
    else:
        rewind_rotating_rows(cache, drop)


def trim_rows(caches: list[Any], drop: list[int]) -> None:
    """Batched attention caches: trim what every row drops, then roll each row's remaining
    surplus to its left edge, where it becomes masked padding (mlx-lm's right-padding
    finalize). Sliding-window layers are rewound their own way."""
    common = min(drop)
    rest = [d - common for d in drop]
    for c in caches:
        if is_rotating(c):
            rewind_rotating_rows(c, drop)
            continue
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            note_right_padding(c, rest)
            finalize(c)
