"""The files of an --input directory: what lies inside it, nothing else.

A directory given to preprocessing is usually a cloned repository, written by someone else. A link in it
(``env.py -> /proc/self/environ``, ``id_rsa.py -> ~/.ssh/id_rsa``) would put whatever it names, readable by the
user, into the dataset; a FIFO would block the reader forever. So the walk takes regular files only:

- a symbolic link is not followed, to a file or a directory (skipped and counted); with ``follow_symlinks`` a link
  to a regular file is followed when its resolved target lies inside the directory (read under the link's path),
  never when it leads out of it or nowhere. Links to directories stay unfollowed: their target inside the
  directory is walked under its own path anyway, and links could loop;
- anything else that is not a regular file or a directory (a FIFO, a socket, a device node) is skipped and counted.

Only the entries found inside a directory are held to this: a file or directory named on the command line is what
the user meant, and is read as named, through a link if it is one. Not detected: a hard link (an ordinary file
whose other name may lie outside; a git clone cannot hold one, an unpacked archive can) and a file system mounted
inside the tree.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

_EXAMPLES = 3  # skipped entries named in the warning


@dataclasses.dataclass
class TreeSkips:
    """What the walks left out, with the first few of each kind (for the warning)."""

    links: int = 0
    """Symbolic links not followed (with --follow-symlinks: those leading out of the directory, to a directory
    or nowhere)."""
    special: int = 0
    """FIFOs, sockets and device nodes."""
    examples: list[str] = dataclasses.field(default_factory=list)

    def skip(self, kind: str, path: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.examples) < _EXAMPLES:
            self.examples.append(path)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _followed(link: str, real_root: str) -> bool:
    """Whether --follow-symlinks reads ``link``: its resolved target is a regular file inside ``real_root``."""
    target = os.path.realpath(link)
    try:
        return _inside(target, real_root) and stat.S_ISREG(os.stat(target).st_mode)
    except OSError:  # dangling, or a loop of links
        return False


def tree_files(root: Path, extensions: tuple[str, ...], follow_symlinks: bool, skips: TreeSkips) -> list[Path]:
    """The regular files under ``root`` whose suffix is in ``extensions``, sorted by their path relative to it;
    what is left out is counted in ``skips`` (module doc). OSError when a directory inside cannot be listed."""
    real_root = os.path.realpath(root)
    found: list[Path] = []
    pending = [str(root)]
    while pending:
        with os.scandir(pending.pop()) as listing:
            entries = list(listing)
        for entry in entries:
            wanted = Path(entry.name).suffix in extensions
            if entry.is_symlink():
                if wanted and follow_symlinks and _followed(entry.path, real_root):
                    found.append(Path(entry.path))
                elif wanted or entry.is_dir():  # is_dir() follows it: a skipped directory counts too
                    skips.skip("links", entry.path)
            elif entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            elif wanted:
                if entry.is_file(follow_symlinks=False):
                    found.append(Path(entry.path))
                else:
                    skips.skip("special", entry.path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())
