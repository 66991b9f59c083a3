"""MkDocs hook (mkdocs.yml ``hooks:``): the site's links to repository files outside docs/.

The rule: a page links a file outside docs/ (a lab record, a benchmark's JSON, a lab plot) by its
relative path, ``../lab/archive/collapse/PREREGISTRATION.md``, which GitHub and an editor follow and
tests/test_docs.py checks. MkDocs builds docs/ only, so left alone such a link is "not found" and
fails ``mkdocs build --strict``. This hook puts a copy of each linked file in the site under
``repo/<its path from the repository root>`` and points the link there, so the built site carries
the evidence its pages cite and works offline:

- a file is copied as it is; a markdown file (a record kept as written, whose own links are not
  the site's) is served as ``<name>.md.txt``, so a browser shows its text instead of downloading it;
- a folder gets a generated page listing its files, each copied.

A link whose target does not exist, or lies outside the repository, is left as written: MkDocs
reports it (a warning, so the strict build fails). MkDocs has no setting for any of this
(``validation`` can only silence such links), hence the hook.
"""
from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

PREFIX = "repo"
_SKIP = {"__pycache__", ".git"}
# Fenced blocks and inline code hold no links: they are split off and kept as they are.
_CODE = re.compile(r"^(```|~~~).*?^\1[^\n]*$|`[^`\n]*`", re.S | re.M)
_LINK = re.compile(r"(!?\[[^\]]*\]\(\s*<?)([^)\s>#]+)(#[^)\s>]*)?")


def _dirs(config) -> tuple[Path, Path]:
    """docs/ and the repository root (mkdocs.yml's folder), absolute."""
    return Path(os.path.abspath(config.docs_dir)), Path(os.path.abspath(config.config_file_path)).parent


def _outside(page_src: Path, target: str, docs: Path, root: Path) -> Path | None:
    """The repository path a page's link leads to when it leaves docs/ and exists, else None."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    # normpath, not resolve(): a linked folder may be a symlink within the repository
    dest = Path(os.path.normpath(page_src.parent / target))
    if docs == dest or docs in dest.parents or root not in dest.parents or not dest.exists():
        return None
    return dest


def _rewrite(markdown: str, replace) -> str:
    """``markdown`` with ``replace(link target)`` applied to every link outside code."""
    out, last = [], 0
    for code in _CODE.finditer(markdown):
        out.append(_LINK.sub(replace, markdown[last : code.start()]))
        out.append(code.group(0))
        last = code.end()
    out.append(_LINK.sub(replace, markdown[last:]))
    return "".join(out)


def _site_path(dest: Path, root: Path) -> str:
    """Where a repository file or folder lives in the site (a docs-relative source path)."""
    rel = dest.relative_to(root).as_posix()
    if dest.is_dir():
        return f"{PREFIX}/{rel}/index.md"
    return f"{PREFIX}/{rel}.txt" if dest.suffix == ".md" else f"{PREFIX}/{rel}"


def _add(files: Files, config, src_uri: str, **source) -> None:
    if files.get_file_from_path(src_uri) is None:
        files.append(File.generated(config, src_uri, inclusion=InclusionLevel.NOT_IN_NAV, **source))


def _add_folder(files: Files, config, folder: Path, root: Path) -> None:
    """A listing page for ``folder``, and a copy of every file under it."""
    members = sorted(p for p in folder.rglob("*") if p.is_file() and not _SKIP & set(p.relative_to(folder).parts))
    rel = folder.relative_to(root).as_posix()
    lines = [f"# {rel}/", "", f"The files of the repository's `{rel}/`, as committed.", ""]
    for member in members:
        name = member.relative_to(folder).as_posix()
        lines.append(f"- [{name}]({posixpath.relpath(_site_path(member, root), f'{PREFIX}/{rel}')})")
        _add(files, config, _site_path(member, root), abs_src_path=str(member))
    _add(files, config, _site_path(folder, root), content="\n".join(lines) + "\n")


def on_files(files: Files, config) -> Files:
    docs, root = _dirs(config)
    for page in [f for f in files if f.is_documentation_page() and f.abs_src_path]:
        src = Path(page.abs_src_path)

        def collect(m: re.Match) -> str:
            dest = _outside(src, m.group(2), docs, root)
            if dest is not None and dest.is_dir():
                _add_folder(files, config, dest, root)
            elif dest is not None:
                _add(files, config, _site_path(dest, root), abs_src_path=str(dest))
            return m.group(0)

        _rewrite(src.read_text(encoding="utf-8"), collect)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not page.file.abs_src_path:
        return markdown  # a generated listing page: its links are the site's already
    docs, root = _dirs(config)
    src = Path(page.file.abs_src_path)

    def point(m: re.Match) -> str:
        dest = _outside(src, m.group(2), docs, root)
        if dest is None:
            return m.group(0)
        target = posixpath.relpath(_site_path(dest, root), posixpath.dirname(page.file.src_uri) or ".")
        return m.group(1) + target + (m.group(3) or "")

    return _rewrite(markdown, point)
