"""``kvfabric token new FILE``: a fresh random token (or cluster secret) in a 0600 file.

The file is created with ``O_EXCL`` at mode 0600 (no moment where another user could read
it), its missing parent directories at 0700; an existing file is kept unless ``--force``
(then it is replaced atomically, still 0600). The same file format serves ``auth.token_file``
(the admin token) and ``cluster.secret_file`` (at least 16 bytes; one file copied to every
node); use two files, so that a client holding the token cannot impersonate a peer.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvfabric.commands.common import EXIT_USAGE, add_command, fail

TOKEN_BYTES = 32  # 256 random bits, printed as 43 URL-safe characters

DESCRIPTION = """\
Write a new random token to FILE (mode 0600: readable by you only) and print how to use it.
The same kind of file serves as the daemon's admin token (auth.token_file) and as the cluster
secret (cluster.secret_file); make one file for each.

examples:
  kvfabric token new ~/.local/share/kvfabric/admin-token
  kvfabric token new ~/.local/share/kvfabric/cluster-secret"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        commands, "token", help="make token and cluster secret files", description=DESCRIPTION
    )
    actions = parser.add_subparsers(dest="token_action", required=True, metavar="ACTION")
    new = add_command(
        actions, "new", help="write a new random token to a 0600 file", description=DESCRIPTION
    )
    new.add_argument("file", type=Path, metavar="FILE", help="where to write it")
    new.add_argument(
        "--force",
        action="store_true",
        help="replace FILE if it exists (clients holding the old token lose access)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import secrets  # hashlib and random: not for --help

    path = args.file.expanduser()
    try:
        write_token_file(path, secrets.token_urlsafe(TOKEN_BYTES), replace=args.force)
    except FileExistsError:
        return fail("token", f"{path} exists; keep it, or pass --force to replace it", EXIT_USAGE)
    except OSError as exc:
        return fail("token", f"cannot write {path}: {exc.strerror or exc}", EXIT_USAGE)
    shown = str(path.resolve())
    print(
        f"wrote a new token to {shown} (mode 0600)\n"
        f"as the daemon's admin token:  auth.token_file: {shown}\n"
        f"                              (or kvfabric serve --auth-token-file {shown})\n"
        f'for clients and engines:      export KVFABRIC_TOKEN="$(cat {shown})"\n'
        f"as a cluster secret (a file of its own, copied to every node):\n"
        f"                              cluster.secret_file: {shown}"
    )
    return 0


def write_token_file(path: Path, token: str, *, replace: bool = False) -> None:
    """``token`` + newline at ``path``, mode 0600 from the first byte on."""
    import secrets

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = path
    if replace:  # write beside it, then rename over it: readers see the old or the new one
        target = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start
    try:
        os.fchmod(fd, 0o600)  # whatever the umask left
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    if replace:
        os.replace(target, path)
