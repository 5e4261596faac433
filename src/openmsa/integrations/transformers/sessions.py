# SPDX-License-Identifier: Apache-2.0
"""The openmsa side of each live transformers cache (a session: a row of pages per batch row),
kept while the cache object lives; a forward without a cache gets a temporary session for that
step alone."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .pages import PagedCaches, _Row


@dataclass
class _Session:
    """The openmsa side of one transformers cache: a row per batch row."""
    rows: list[_Row]
    columns: int = 0                      # tokens (padding included) the cache has seen


class SessionStore:
    """Sessions by transformers cache (`len()`: how many live caches hold pages)."""

    def __init__(self, pages: PagedCaches):
        self._pages = pages
        self._live: dict[int, tuple[weakref.ref, _Session]] = {}
        self._temporary: _Session | None = None
        # sessions whose cache was garbage collected; released at the next step or collect(),
        # never inside the callback (which may run in the middle of a page allocation)
        self._dead: list[int] = []

    def __len__(self) -> int:
        return len(self._live)

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._pages.release(entry[1].rows)

    def collect(self) -> None:
        """Release the pages of the sessions whose transformers cache is gone."""
        while self._dead:
            key = self._dead.pop()
            entry = self._live.get(key)
            if entry is not None and entry[0]() is None:
                self._drop(key)

    def release_temporary(self) -> None:
        if self._temporary is not None:
            self._pages.release(self._temporary.rows)
            self._temporary = None

    def open(self, cache, batch: int, past: int) -> _Session:
        """The session of a step of `batch` rows after `past` cached tokens: a new one when the
        cache is empty (or absent), else the one that wrote those tokens."""
        if cache is None:
            if past:
                raise ValueError("use_openmsa: a step after cached tokens needs the cache")
            self._temporary = _Session([_Row() for _ in range(batch)])
            return self._temporary
        key = id(cache)
        entry = self._live.get(key)
        session = entry[1] if entry is not None and entry[0]() is cache else None
        if past == 0:
            if entry is not None:
                self._drop(key)
            session = _Session([_Row() for _ in range(batch)])
            self._live[key] = (weakref.ref(cache, lambda _, k=key: self._dead.append(k)),
                               session)
        elif session is None or session.columns != past:
            have = "none" if session is None else session.columns
            raise ValueError(f"use_openmsa: the cache holds {past} tokens but openmsa wrote "
                             f"{have} for it (a cache filled before use_openmsa, cropped, or "
                             f"reordered, as beam search or assisted decoding do, is not "
                             f"supported)")
        if len(session.rows) != batch:
            raise ValueError(f"use_openmsa: the batch has {batch} rows but its cache was "
                             f"started with {len(session.rows)}")
        return session
