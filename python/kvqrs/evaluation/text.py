"""Evaluation and calibration text, all local: a file, a WikiText-2/103 raw copy, or the default
that ships inside a package (the Wikipedia articles in gensim's wheel,
``gensim/test/test_data/enwiki-...-shortened.bz2``, markup stripped by gensim's own
``filter_wiki``). Nothing is downloaded."""

from __future__ import annotations

import bz2
import importlib.util
import pathlib
import re
from dataclasses import dataclass

from .._arrays import KvqrsError

GENSIM_WIKI = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@dataclass(frozen=True)
class Texts:
    """Evaluation text, a disjoint calibration text, and where they came from."""

    evaluation: str
    calibration: str
    source: str


def _split(text: str) -> tuple[str, str]:
    """Calibration = first 20% of the characters (at a paragraph break), evaluation = the rest."""
    cut = text.find("\n", len(text) // 5)
    cut = cut if cut > 0 else len(text) // 5
    return text[cut:], text[:cut]


def from_file(path: str | pathlib.Path) -> Texts:
    """A plain UTF-8 text file (the first 20% calibrates HeadQ, the rest is evaluated)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise KvqrsError(f"--data: expected a readable text file, got {str(p)!r}")
    raw = p.read_text(encoding="utf-8", errors="replace")
    if not raw.strip():
        raise KvqrsError(f"--data: {str(p)!r} holds no text (it is empty or only whitespace)")
    ev, cal = _split(raw)
    return Texts(ev, cal, f"file {p}")


def from_wikitext(folder: str | pathlib.Path) -> Texts:
    """A local WikiText-2/103 raw copy: ``wiki.test.raw`` is evaluated, ``wiki.valid.raw`` (or
    ``wiki.valid.tokens``) calibrates."""
    d = pathlib.Path(folder)
    test = d / "wiki.test.raw"
    valid = next((d / n for n in ("wiki.valid.raw", "wiki.valid.tokens", "wiki.train.raw") if (d / n).is_file()), None)
    if not test.is_file() or valid is None:
        raise KvqrsError(f"--wikitext: expected wiki.test.raw and wiki.valid.raw (or .tokens) in {str(d)!r}")
    return Texts(test.read_text(encoding="utf-8"), valid.read_text(encoding="utf-8"), f"WikiText raw at {d}")


def default() -> Texts:
    """The Wikipedia articles that ship in gensim's wheel, wiki markup stripped with gensim's
    ``filter_wiki``: the first 20 articles calibrate, the rest are evaluated."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise KvqrsError("the default evaluation text needs the gensim package (pip install gensim), or pass --data / --wikitext")
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = pathlib.Path(spec.submodule_search_locations[0]) / GENSIM_WIKI
    articles = []
    with bz2.open(path) as f:
        for title, markup, _ in extract_pages(f):
            body = re.sub(r"'{2,}", "", filter_wiki(markup))
            body = re.sub(r"\n{3,}", "\n\n", body).strip()
            if len(body) > 2000:
                articles.append(f"= {title} =\n\n{body}\n")
    return Texts("\n".join(articles[20:]), "\n".join(articles[:20]), f"gensim {GENSIM_WIKI} ({len(articles)} articles)")
