"""The ``rdma-kv`` command line: ``bench``, ``demo``, ``info`` and ``selftest``.

Only the CLI configures logging; the library itself only adds a
NullHandler. Subcommands live in their own modules and import what they
need lazily, so ``rdma-kv --help`` loads neither UCX nor torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from rdma_kv import __version__
from rdma_kv.cli import bench, demo, info, selftest
from rdma_kv.errors import ConfigError, RdmaKVError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdma-kv",
        description="Zero-copy KV-cache transfer over one-sided UCX reads.",
    )
    parser.add_argument("--version", action="version", version=f"rdma-kv {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench.add_parser(sub)
    demo.add_parser(sub)
    info.add_parser(sub)
    selftest.add_parser(sub)
    return parser


def pin_loopback() -> None:
    """demo and bench move data between processes on this host only: keep UCX's
    network transports on the loopback device (with TCP enabled, UCX would also
    stripe RMA over eth0's address). Set in the CLI -- the application -- never
    in the library, and only when the operator has not chosen devices."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def check_output(flag: str, path: str | None) -> None:
    """Refuse, before a run, an output path that cannot be written (a
    directory that does not exist, no permission, a read-only file system):
    found after a run, it lost minutes of checks or benchmarks to a
    traceback. Opens it for appending (nothing truncated) and removes it
    again if this made it."""
    if not path:
        return
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot write it ({exc.strerror or exc}); "
                          "give a path in a directory that exists and that you may write") from None
    if not existed:
        os.unlink(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # `demo` hands its options to the demo's own parser (parse_known_args);
    # every other command must have consumed all of them.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.run(args))
    except RdmaKVError as exc:
        print(f"rdma-kv {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
