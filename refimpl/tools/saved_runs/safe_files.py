"""Files that a crash, a second writer or a planted link cannot damage (used by sharded.py).

Four rules, each a function here:

  * create_new(path): a file is created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW): if anything
    exists at that name -- a file, a directory, a symbolic link planted there -- creation fails
    instead of writing through it.
  * write_atomically(path): a file that replaces another is written to a fresh temporary file in
    the same directory (a random name, created exclusively), flushed to disk, and renamed over the
    target (os.replace is atomic on POSIX): readers see the old file or the
    new one, never a part of either, and two writers never share a temporary file.
  * publish(staging, final): a directory of files (one checkpoint step) is written complete under
    a temporary name, then renamed into place; an existing directory of that name is first moved
    aside and removed only after the new one is in place.
  * open_confined(directory, name): a file named by a manifest is read only if the name is a plain
    file name and the file, links resolved, lies inside the directory -- checked before the file
    is opened.

Output paths named on the command line (train --trace and --save-dir, consolidate --out, and any
command's output file: check_output_file, check_output_directory) are checked before the command
does its work, so that a bad path is one line at the start instead of a traceback after the run.
The rule for symbolic links, the same for every output:

  * links in the directories leading to an output are followed, and so is a --save-dir that is
    itself a link to a directory (a scratch disk linked into the working directory);
  * an output *file* whose name is a symbolic link is refused: outputs are written atomically
    (write_atomically renames a temporary file over the name), which would replace the link
    rather than write its target, so the command asks for the target's name instead.

What the operating system does not promise: after a power loss, a file system that does not
order metadata (some network file systems) may show a rename before the data it names; fsync of
files and of their directories, as done here, is what POSIX offers against that.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import tempfile

from refimpl.tools.runtime import watchdog

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def create_new(path: str, write) -> tuple[str, int]:
    """Create `path` exclusively, write(file object) into it, flush it to disk; (sha256, bytes).

    FileExistsError if anything is at `path` already (a symbolic link included: it is not followed).
    """
    with _open_new(path) as f:
        return _write_and_hash(f, write)


def write_atomically(path: str, write, durable: bool = True) -> tuple[str, int]:
    """Replace `path` by a file that write(file object) fills; (sha256, bytes). On an error nothing
    at `path` changes and the temporary file is removed. durable=False skips the fsyncs (a
    diagnostic rewritten often, such as a trace: still atomic, not flushed to disk)."""
    directory, base = os.path.split(os.path.abspath(path))
    tmp = _fresh_name(directory, base, "tmp")
    f = _open_new(tmp)  # if this fails, nothing was created: there is nothing of ours to remove
    try:
        with f:
            digest, size = _write_and_hash(f, write, durable)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if durable:
        fsync_directory(directory)
    return digest, size


def _open_new(path: str):
    """A new file at `path`, open for reading and writing; FileExistsError if any name is there."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666), "w+b")


def _write_and_hash(f, write, durable: bool = True) -> tuple[str, int]:
    write(f)
    f.flush()
    if durable:
        os.fsync(f.fileno())
    watchdog.progress()  # a file written: the ranks that wait meanwhile see this one alive
    f.seek(0)  # hash what is on disk, through the same descriptor (np.savez seeks while writing)
    return sha256_of(f)


def sha256_of(f) -> tuple[str, int]:
    """(sha256, bytes) of an open binary file, read from its current position to its end."""
    h, size = hashlib.sha256(), 0
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def make_staging_directory(root: str, name: str) -> str:
    """A new, empty directory in `root` in which `name` is assembled (created exclusively: mkdir
    fails on any existing name, a symbolic link included)."""
    for _ in range(10):
        path = _fresh_name(root, name, "saving")
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a staging directory for {name} in {root}")


def publish(staging: str, final: str) -> None:
    """Rename the complete directory `staging` to `final`. An existing `final` is renamed aside first
    and removed after: a crash between the two renames leaves no `final` at all (readers fall back to
    an older one), never a mixture of old and new files."""
    root = os.path.dirname(final)
    fsync_directory(staging)
    old = None
    if os.path.lexists(final):
        old = _fresh_name(root, os.path.basename(final), "replaced")
        os.rename(final, old)
    os.rename(staging, final)
    fsync_directory(root)
    if old is not None:
        remove(old)


def remove(path: str) -> None:
    """Remove a directory tree, atomically as seen by readers: renamed to a hidden name first, then
    deleted. A symbolic link is removed, never followed."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    root, base = os.path.split(path)
    if not base.startswith("."):  # readers ignore hidden names: from here on the directory is gone
        hidden = _fresh_name(root, base, "removing")
        os.rename(path, hidden)
        path = hidden
    shutil.rmtree(path)


def open_confined(directory: str, name, what: str = "file"):
    """Open `name` for reading if it is a plain file name inside `directory` (links resolved); a
    ValueError naming the problem otherwise, raised before anything is opened. check_name first
    when several names must all be valid before any is read."""
    path = check_name(directory, name, what)
    try:
        return open_regular(path, f"{what} {name}", os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        raise ValueError(f"{what} {name} is missing") from None


def open_regular(path: str, what: str, flags: int = os.O_RDONLY):
    """Open `path` for reading if it is a regular file; a ValueError naming `what` otherwise. The file
    is opened without blocking (O_NONBLOCK) and checked before anything is read: opening a FIFO for
    reading would otherwise wait for a writer forever, and a device could be read without end.
    FileNotFoundError passes through."""
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"{what} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{what} is not a regular file (a directory, FIFO or device)")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_name(directory: str, name, what: str = "file") -> str:
    """The resolved path of `name` in `directory`; ValueError unless it is a plain file name (no
    directory part, not absolute, not '..') whose target, symbolic links resolved, is inside it."""
    if (not isinstance(name, str) or name in ("", ".", "..") or os.path.isabs(name)
            or os.path.basename(name) != name or "\0" in name):
        raise ValueError(f"the manifest names {what} {name!r}, which is not a file name inside the checkpoint "
                         "directory (absolute paths and '..' are refused); the manifest is damaged or forged")
    inside = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(inside, name))
    if os.path.commonpath([target, inside]) != inside:
        raise ValueError(f"{what} {name} is a symbolic link to {target}, outside the checkpoint directory; "
                         "copy the file into the directory instead")
    return target


def check_output_file(path, flag: str, example: str = "out") -> str:
    """ValueError, one line naming `flag`, unless `path` names a file this process can write
    atomically (write_atomically): not a directory, not a symbolic link (the module's rule), not a
    device or other special file, not read-only, in an existing directory where a new file can be
    created. Nothing is created or changed. Returns the path."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag} needs a file name")
    if os.path.islink(path):
        raise ValueError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}); an output is written to a "
                         "temporary file renamed over its name, which would replace the link, not write its target: "
                         "name the target itself (refimpl/tools/saved_runs/safe_files.py states the rule)")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; name a file, e.g. {os.path.join(path, example)}")
    if os.path.lexists(path):
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{flag} {path} is not a regular file (a device, pipe or socket); name a file")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path} is read-only; make it writable or name another file")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise ValueError(f"{flag} {path} cannot be written: its directory {parent} {what}; create it first")
    try:
        with tempfile.TemporaryFile(dir=parent, prefix=".write_test_"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path} cannot be written: {exc.strerror or exc} (in {parent}); "
                         "choose a writable location") from None
    return path


def check_output_directory(path, flag: str) -> None:
    """ValueError, one line naming `flag`, unless `path` is a directory this process can write
    into, or can be created (its nearest existing ancestor is a writable directory). Links are
    followed (the module's rule). Nothing is created or changed."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag} needs a directory name")
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    reason = None
    if not os.path.isdir(existing):
        reason = (f"{existing} is a symbolic link to {os.readlink(existing)}, which does not exist"
                  if os.path.islink(existing) and not os.path.exists(existing) else "Not a directory")
    else:
        try:
            with tempfile.TemporaryFile(dir=existing, prefix=".write_test_"):
                pass
        except OSError as exc:
            reason = f"{exc.strerror or exc}" + ("" if existing == os.path.abspath(path) else f" (in {existing})")
    if reason:
        raise ValueError(f"{flag} {path!r} cannot be written: {reason}; choose a writable directory")


def fsync_directory(path: str) -> None:
    """Flush a directory's entries (new names, renames) to disk, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory
    finally:
        os.close(fd)


def _fresh_name(directory: str, base: str, kind: str) -> str:
    """A hidden, unpredictable name beside `base`: .BASE.RANDOM.KIND (readers skip hidden names)."""
    return os.path.join(directory, f".{base}.{secrets.token_hex(6)}.{kind}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
