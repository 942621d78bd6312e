"""Delayed conversion (`quantized_start`): a row keeps a dense KV cache until it holds N tokens,
then converts to a quantized target layout at its own boundary; rows in different phases share
one batch and one forward. Engine thread only.

When a row converts: in the forward whose cache update brings its token count to >= N (checked
in `update_and_fetch`, so every layer converts in the same forward), that forward still attends
densely, and every later forward uses the target layout. That is exactly mlx-lm's
`maybe_quantize_kv_cache`, which runs after each model call (so N = 0 means: the first forward,
a whole prefill chunk, is dense). A converted row stays converted, even if trimmed below N.

Prompt-cache rule: a per-row cache with `converted_at = C` holds target-layout tokens that a
dense row would not hold below C; it must never be reused at a prefix shorter than C (a cache
trimmed below its boundary would attend to quantized tokens a cold run attends to densely).

Target layout protocol (AffineKVCache in quantized.py; TurboQuant in turbo.py):
- Per-row class T: `T(**params)` is an empty row; `T.from_dense(kv: KVCache, **params)`
  quantizes all `kv.offset` tokens of a dense row (leaving it as it was). Methods:
  update_and_fetch(keys, values) -> (k, v); attend(queries, k, v, *, scale, mask) taking
  exactly what update_and_fetch returned; trim, is_trimmable, size, empty, nbytes, make_mask;
  int `offset`; mlx-lm's `state` / `from_state` round trip (settings included); classmethod
  merge(list[T]) -> TB. A DelayedKVCache holds its T (or, before converting, its KVCache) as
  `inner` and delegates to it.
- Batch class TB = type(T.merge([T(**params)])), built as `TB.from_dense(batch: BatchKVCache,
  **params)` keeping the batch's row layout (new objects for left_padding, offset and pending
  _right_padding; same _idx). BatchKVCache's semantics: update_and_fetch, attend, make_mask
  (same mask as BatchKVCache for the same layout), filter, extend, extract(i) -> T, trim, size,
  empty, nbytes, state, prepare/finalize; attributes left_padding, offset (mx arrays), _idx.
- Quantization is per token: from_dense of tokens [0, n) followed by update_and_fetch of
  [n, m) stores exactly what from_dense of [0, m) stores. The batch relies on it: its target
  storage holds every row (dense rows included) once any row has converted.

Conversions are reported to `on_convert(num_tokens)`, given to the cache (the KV layout passes
its own; pipeserve/kv/layouts.py): called once per converted layer cache of a row, with the
row's token count. It is not state: a cache rebuilt by `from_state` has none until the layout
adopts it."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache
from pipeserve.kv.attention import dense_attention, tag_fetched

OnConvert = Callable[[int], None]

_classes: dict[str, type] = {}


def _layout_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _layout(name: str) -> type:
    if name not in _classes:
        module, _, attr = name.partition(":")
        _classes[name] = getattr(importlib.import_module(module), attr)
    return _classes[name]


def _batch_layout(name: str, params: tuple[tuple[str, Any], ...]) -> type:
    """The target's batch class: what its per-row class's `merge` builds."""
    key = f"{name}/batch"
    if key not in _classes:
        row_cls = _layout(name)
        _classes[key] = type(row_cls.merge([row_cls(**dict(params))]))
    return _classes[key]


class _Settings:
    """What a delayed row and a delayed batch share: the boundary, the target layout and its
    parameters, and the dense shape learnt from the first write."""

    quantized_start: int
    target_layout: str                          # "module:Class" of the per-row target
    target_params: tuple[tuple[str, Any], ...]
    dense_dims: tuple[int, int, int] | None     # (kv heads, key dim, value dim)
    dense_dtype: str | None
    on_convert: OnConvert | None

    def _set_settings(self, start: int, layout: str, params: Any, dims: Any,
                      dtype: str | None) -> None:
        self.quantized_start = start
        self.target_layout = layout
        self.target_params = tuple((str(k), v) for k, v in params)
        self.dense_dims = None if dims is None else tuple(dims)
        self.dense_dtype = dtype

    def _settings(self) -> tuple[Any, ...]:
        """The arguments of `_set_settings`, as stored in `state`."""
        return (self.quantized_start, self.target_layout, self.target_params, self.dense_dims,
                self.dense_dtype)

    def _same_kind(self) -> tuple[Any, ...]:
        """What rows must agree on to share a batch (start, layout, params)."""
        return self.quantized_start, self.target_layout, self.target_params

    def _learn_dims(self, keys: mx.array, values: mx.array) -> None:
        if self.dense_dims is None:
            self.dense_dims = (keys.shape[1], keys.shape[3], values.shape[3])
            self.dense_dtype = str(keys.dtype).removeprefix("mlx.core.")

    def _counted(self, num_tokens: int) -> None:
        if self.on_convert is not None:
            self.on_convert(num_tokens)


class DelayedKVCache(_Settings, _BaseCache):
    """One row: `inner` is a dense mlx-lm KVCache until the row holds `start` tokens, then the
    target layout's row cache (`target_cls.from_dense` of it); every cache method delegates to
    `inner`. `converted_at` is the token count at which the row converted, or None while dense.
    `state` is (inner's state, settings, converted_at), so `from_state` rebuilds the row."""

    def __init__(self, start: int, target_cls: type, *, on_convert: OnConvert | None = None,
                 **params: Any) -> None:
        if start < 0:
            raise ValueError(f"quantized_start must be >= 0 tokens, got {start}")
        self._set_settings(start, _layout_name(target_cls), sorted(params.items()), None, None)
        self.on_convert = on_convert
        self.inner: Any = KVCache()
        self.converted_at: int | None = None
        self.attend_dense = True          # whether the last update_and_fetch returned dense arrays

    @classmethod
    def _like(cls, settings: _Settings, inner: Any, converted_at: int | None) -> DelayedKVCache:
        """A row with the settings (and conversion callback) of `settings` holding `inner`."""
        row = cls.__new__(cls)
        row._set_settings(*settings._settings())
        row.on_convert = settings.on_convert
        row.inner, row.converted_at = inner, converted_at
        row.attend_dense = converted_at is None
        return row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self.converted_at is not None:
            self.attend_dense = False
            k, v = self.inner.update_and_fetch(keys, values)
            return tag_fetched(k, self), tag_fetched(v, self)
        self._learn_dims(keys, values)
        self.attend_dense = True
        fetched = self.inner.update_and_fetch(keys, values)
        if self.inner.offset >= self.quantized_start:   # this forward stays dense; later not
            target = _layout(self.target_layout).from_dense(self.inner,
                                                            **dict(self.target_params))
            self.inner, self.converted_at = target, target.offset
            self._counted(target.offset)
        return fetched

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float,
               mask: Any) -> mx.array:
        if self.attend_dense:
            return dense_attention(queries, keys, values, scale, mask)
        return self.inner.attend(queries, keys, values, scale=scale, mask=mask)

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.inner.state, *self._settings(), self.converted_at)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        inner, *settings, converted_at = v
        self._set_settings(*settings)
        self.converted_at = converted_at
        cls = KVCache if converted_at is None else _layout(self.target_layout)
        self.inner = cls.from_state(inner)
        self.attend_dense = converted_at is None

    @classmethod
    def from_state(cls, state: tuple[Any, ...]) -> DelayedKVCache:
        obj = cls.__new__(cls)
        obj.on_convert = None   # not state: the layout gives it back (adopt)
        obj.state = state
        return obj

    @property
    def offset(self) -> int:
        return self.inner.offset

    def is_trimmable(self) -> bool:
        return self.inner.is_trimmable()

    def trim(self, n: int) -> int:
        return self.inner.trim(n)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.make_mask(*args, **kwargs)

    def size(self) -> int:
        return self.inner.offset

    def empty(self) -> bool:
        return self.inner.empty()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @classmethod
    def merge(cls, caches: list[DelayedKVCache]) -> DelayedBatchKVCache:
        return DelayedBatchKVCache.merge(caches)


class DelayedBatchKVCache(_Settings, _BaseCache):
    """DelayedKVCache rows in one left-padded batch (BatchKVCache semantics). `dense`
    (BatchKVCache) exists while any row is dense, `target` (the target's batch class) once any
    row has converted; while both exist both hold every row, in the same layout (converted rows'
    dense slots are zeros), and a forward computes both attentions and picks per row, so each
    row gets what it would get alone. `lengths` is the host copy of the per-row `offset`."""

    def __init__(self, start: int, target_cls: type, num_rows: int = 0, *,
                 on_convert: OnConvert | None = None, **params: Any) -> None:
        self._set_settings(start, _layout_name(target_cls), sorted(params.items()), None, None)
        self.on_convert = on_convert
        self.dense: BatchKVCache | None = BatchKVCache([0] * num_rows)
        self.target: Any = None
        self.converted_at: list[int | None] = [None] * num_rows
        self.lengths: list[int] = [0] * num_rows
        self.attend_target: list[bool] = [False] * num_rows   # per row, in the current forward
        self.right_padding: list[int] | None = None   # of a prompt forward awaiting finalize()

    def _from_dense(self, dense: BatchKVCache) -> Any:
        params = self.target_params
        return _batch_layout(self.target_layout, params).from_dense(dense, **dict(params))

    def _zeros_dense(self) -> BatchKVCache:
        """Dense storage of zeros in the target storage's row layout (for converted rows)."""
        ref = self.target
        heads, k_dim, v_dim = self.dense_dims
        dtype = getattr(mx, self.dense_dtype)
        dense = BatchKVCache([])
        rows = len(self.lengths)
        dense.keys = mx.zeros((rows, heads, ref._idx, k_dim), dtype)
        dense.values = mx.zeros((rows, heads, ref._idx, v_dim), dtype)
        dense.left_padding, dense.offset = ref.left_padding[...], ref.offset[...]   # own objects
        dense._idx = ref._idx
        return dense

    # -- forward ------------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._learn_dims(keys, values)
        self.attend_target = [c is not None for c in self.converted_at]
        dense_kv = target_kv = (None, None)
        if self.dense is not None:
            dense_kv = self.dense.update_and_fetch(keys, values)
        if self.target is not None:
            target_kv = self.target.update_and_fetch(keys, values)
        self.lengths = [m + keys.shape[2] for m in self.lengths]
        if self.right_padding is None:
            self._convert_due()
        if not any(self.attend_target):
            target_kv = (None, None)
        return (tag_fetched((dense_kv[0], target_kv[0]), self),
                tag_fetched((dense_kv[1], target_kv[1]), self))

    def _convert_due(self) -> None:
        due = [i for i, (c, m) in enumerate(zip(self.converted_at, self.lengths))
               if c is None and m >= self.quantized_start]
        if not due:
            return
        if self.target is None:
            self.target = self._from_dense(self.dense)
        for i in due:
            self.converted_at[i] = self.lengths[i]
            self._counted(self.lengths[i])
        if all(c is not None for c in self.converted_at):
            self.dense = None   # arrays fetched for this forward stay alive until it ends

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float,
               mask: Any) -> mx.array:
        (dense_k, target_k), (dense_v, target_v) = keys, values
        if target_k is None:
            return dense_attention(queries, dense_k, dense_v, scale, mask)
        quant = self.target.attend(queries, target_k, target_v, scale=scale, mask=mask)
        if dense_k is None:
            return quant
        plain = dense_attention(queries, dense_k, dense_v, scale, mask)
        return mx.where(mx.array(self.attend_target)[:, None, None, None], quant, plain)

    def _storages(self) -> list[Any]:
        return [c for c in (self.dense, self.target) if c is not None]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return self._storages()[0].make_mask(N, return_array=return_array, **kwargs)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        for inner in self._storages():
            inner.prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if left_padding is not None:
            self.lengths = [m - p for m, p in zip(self.lengths, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self.right_padding = list(right_padding)

    def finalize(self) -> None:
        for inner in self._storages():
            inner.finalize()
        if self.right_padding is not None:
            self.lengths = [m - p for m, p in zip(self.lengths, self.right_padding)]
            self.right_padding = None
            self._convert_due()

    # -- rows ---------------------------------------------------------------------------------
    def filter(self, batch_indices: mx.array) -> None:
        keep = batch_indices.tolist()
        for inner in self._storages():
            inner.filter(batch_indices)
        self.converted_at = [self.converted_at[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self.attend_target = [self.attend_target[i] for i in keep]
        if all(c is not None for c in self.converted_at):
            self.dense = None
        if all(c is None for c in self.converted_at):
            self.target = None

    def extend(self, other: DelayedBatchKVCache) -> None:
        """Append `other`'s rows; each side gains the storage the other has first."""
        if other._same_kind() != self._same_kind():
            raise ValueError("cannot extend a delayed batch by one with another start or layout")
        self.dense_dims = self.dense_dims or other.dense_dims
        self.dense_dtype = self.dense_dtype or other.dense_dtype
        self.on_convert = self.on_convert or other.on_convert
        sides = (self, other)
        need_dense = any(s.dense is not None for s in sides)
        need_target = any(s.target is not None for s in sides)
        for s in sides:   # both sides get both storages before either is extended
            if need_target and s.target is None:
                s.target = s._from_dense(s.dense)
            if need_dense and s.dense is None:
                s.dense_dims, s.dense_dtype = self.dense_dims, self.dense_dtype
                s.dense = s._zeros_dense()
        if need_dense:
            self.dense.extend(other.dense)
        if need_target:
            self.target.extend(other.target)
        self.converted_at = self.converted_at + other.converted_at
        self.lengths = self.lengths + other.lengths
        self.attend_target = self.attend_target + other.attend_target

    def extract(self, i: int) -> DelayedKVCache:
        """Row `i` as a per-row cache in its own phase (copied, without padding)."""
        if self.converted_at[i] is not None:
            inner = self.target.extract(i)
        elif self.dense.keys is not None:
            inner = self.dense.extract(i)
        else:
            inner = KVCache()
        return DelayedKVCache._like(self, inner, self.converted_at[i])

    @classmethod
    def merge(cls, caches: list[DelayedKVCache]) -> DelayedBatchKVCache:
        """Per-row caches (any phases) → one batch, each row right-aligned (left-padded)."""
        kinds = {c._same_kind() for c in caches}
        if len(kinds) != 1:
            raise ValueError(f"cannot merge delayed rows with different settings "
                             f"(start, layout, params): {sorted(kinds)}")
        batch = cls.__new__(cls)
        batch._set_settings(*caches[0]._settings())
        batch.on_convert = next((c.on_convert for c in caches if c.on_convert is not None), None)
        shaped = next((c for c in caches if c.dense_dims is not None), None)
        if shaped is not None:
            batch.dense_dims, batch.dense_dtype = shaped.dense_dims, shaped.dense_dtype
        batch.converted_at = [c.converted_at for c in caches]
        batch.lengths = [c.offset for c in caches]
        batch.attend_target = [c is not None for c in batch.converted_at]
        batch.right_padding = None
        batch.dense = batch.target = None
        if any(c is None for c in batch.converted_at):
            batch.dense = BatchKVCache.merge([batch._dense_row(c) for c in caches])
        if any(c is not None for c in batch.converted_at):
            target_cls = _layout(batch.target_layout)
            params = dict(batch.target_params)
            batch.target = target_cls.merge([
                c.inner if c.converted_at is not None
                else target_cls.from_dense(c.inner, **params) for c in caches])
        return batch

    def _dense_row(self, row: DelayedKVCache) -> KVCache:
        if row.converted_at is None:
            return row.inner
        heads, k_dim, v_dim = self.dense_dims
        dtype = getattr(mx, self.dense_dtype)
        kv = KVCache()
        kv.keys = mx.zeros((1, heads, row.offset, k_dim), dtype)
        kv.values = mx.zeros((1, heads, row.offset, v_dim), dtype)
        kv.offset = row.offset
        return kv

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return self._storages()[0].offset

    @property
    def left_padding(self) -> mx.array:
        return self._storages()[0].left_padding

    @property
    def state(self) -> tuple[Any, ...]:
        """(dense storage's state or None, target storage's state or None, settings,
        converted_at, lengths). A batch between prepare(right_padding=...) and finalize() is
        not kept, as mlx-lm's BatchKVCache keeps no pending right padding."""
        return (None if self.dense is None else self.dense.state,
                None if self.target is None else self.target.state,
                *self._settings(), tuple(self.converted_at), tuple(self.lengths))

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        dense, target, *settings, converted_at, lengths = v
        self._set_settings(*settings)
        self.dense = self.target = None
        if dense is not None:
            self.dense = BatchKVCache.from_state(dense)
            self.dense._right_padding = None   # not part of mlx-lm's state
        if target is not None:
            self.target = _batch_layout(self.target_layout, self.target_params).from_state(target)
        self.converted_at, self.lengths = list(converted_at), list(lengths)
        self.attend_target = [c is not None for c in self.converted_at]
        self.right_padding = None

    @classmethod
    def from_state(cls, state: tuple[Any, ...]) -> DelayedBatchKVCache:
        obj = cls.__new__(cls)
        obj.on_convert = None   # not state: the layout gives it back (adopt)
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        trimmed = [inner.trim(n) for inner in self._storages()][0]
        self.lengths = [m - trimmed for m in self.lengths]
        return trimmed

    def size(self) -> int:
        return self._storages()[0].size()

    def empty(self) -> bool:
        return all(inner.empty() for inner in self._storages())

    @property
    def nbytes(self) -> int:
        return sum(inner.nbytes for inner in self._storages())
