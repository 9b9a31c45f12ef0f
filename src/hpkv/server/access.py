"""Who can reach the server's socket at all: the uids of HPKV_SERVER_ALLOW_UIDS, and no other.

Connecting to a Unix socket takes search permission on its directory and write permission on the
socket. The pool directory is 0700 and the socket is born 0600, so only the server's uid (and
root) reach them; `open_to(directory, socket, uids)` lets the listed uids in as well, by POSIX
ACL entries naming each of them: search (`--x`) on the directory, read/write on the socket. No
one else gains anything, and nobody gains write access to the directory, so no other uid can
replace the names in it (`pool.directory` checks that). On a file system without ACLs (ramfs)
it falls back to modes: directory `o+x`, socket 0666; any local uid can then connect, and the
server's `SO_PEERCRED` check (`connection.admit`), which is the gate in either case, refuses all
but the listed ones. A directory that is not the server's own (a sticky shared one, root's) is
left as it is. With no uids listed, the entries an earlier start added are taken away.
Primitives: `open_to`, `acl_of`. Must not know the protocol or the store.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from pathlib import Path

log = logging.getLogger("hpkv.server")

_XATTR = "system.posix_acl_access"
_VERSION = 2
_ENTRY = struct.Struct("<HHI")  # tag, permissions, id
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_NO_ACLS = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)


def _encode(entries: list[tuple[int, int, int]]) -> bytes:
    ordered = sorted(entries, key=lambda e: (e[0], e[2]))  # the kernel wants them by tag, then id
    return struct.pack("<I", _VERSION) + b"".join(_ENTRY.pack(*entry) for entry in ordered)


def acl_of(path: Path) -> list[tuple[int, int, int]] | None:
    """The access ACL of `path` as (tag, permissions, id) entries; None if it has none."""
    try:
        raw = os.getxattr(path, _XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, *_NO_ACLS):
            return None
        raise
    return [_ENTRY.unpack_from(raw, offset) for offset in range(4, len(raw), _ENTRY.size)]


def _acl(mode: int, named: dict[int, int], group_obj: int | None = None) -> bytes:
    """An ACL keeping `mode`'s owner and other permissions, granting `named` uids their bits."""
    group = (mode >> 3) & 7 if group_obj is None else group_obj
    mask = group
    for perms in named.values():
        mask |= perms
    entries = [(_USER_OBJ, (mode >> 6) & 7, _NO_ID), (_GROUP_OBJ, group, _NO_ID), (_OTHER, mode & 7, _NO_ID)]
    entries += [(_USER, perms, uid) for uid, perms in named.items()]
    if named:
        entries.append((_MASK, mask, _NO_ID))
    return _encode(entries)


def open_to(directory: Path, socket_path: Path, uids: tuple[int, ...]) -> None:
    """Let `uids` (other than this one) reach the socket, and no one else; see the module doc."""
    me = os.geteuid()
    others = tuple(sorted({uid for uid in uids if uid != me}))
    st = os.stat(directory)
    own = st.st_uid == me and not st.st_mode & stat.S_ISVTX
    if own:
        old = acl_of(directory)
        # What the group had before named entries were added (the mode's group bits are the mask then).
        group_obj = next((perms for tag, perms, _ in old or () if tag == _GROUP_OBJ), None)
        if others or (old is not None and any(tag == _USER for tag, _, _ in old)):
            try:
                os.setxattr(directory, _XATTR, _acl(stat.S_IMODE(st.st_mode), dict.fromkeys(others, 1), group_obj))
            except OSError as exc:
                if exc.errno not in _NO_ACLS:
                    raise
                if others:
                    return _open_by_mode(directory, socket_path, others, own)
    if not others:
        return
    try:
        os.setxattr(socket_path, _XATTR, _acl(0o600, dict.fromkeys(others, 6)))
    except OSError as exc:
        if exc.errno not in _NO_ACLS:
            raise
        return _open_by_mode(directory, socket_path, others, own)
    log.info("the socket admits uid(s) %s besides this one (ACL entries; HPKV_SERVER_ALLOW_UIDS)", list(others))


def _open_by_mode(directory: Path, socket_path: Path, others: tuple[int, ...], own: bool) -> None:
    if own:
        os.chmod(directory, stat.S_IMODE(os.stat(directory).st_mode) | 0o001)
    os.chmod(socket_path, 0o666)
    log.warning(
        "the file system of %s takes no ACLs: to admit uid(s) %s (HPKV_SERVER_ALLOW_UIDS) its socket is "
        "open to every local uid (mode 0666, directory searchable by all); the server refuses all but "
        "them by SO_PEERCRED. Fix, for fewer knocks at the door: a pool directory on tmpfs with ACLs",
        directory,
        list(others),
    )
