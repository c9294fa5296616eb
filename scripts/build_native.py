"""Compile the request path's hot modules with mypyc into ``gateway/_native`` (``gateway.native``).

    .venv/bin/python scripts/build_native.py [--force]

Needs a C compiler, the Python headers, mypy (which ships mypyc) and setuptools >= 77 in the
interpreter that runs it (``scripts/setup.sh`` installs them and runs this). Does nothing when
the build is fresh (its stamp matches the source), unless ``--force``. About 4-5 minutes on one
core. The stamp is the source's fingerprint taken before compiling and written last, so an edit
made while it compiles, or a build that fails half-way, leaves no fresh stamp behind: the
gateway then imports its source (``gateway.native.install``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["KVGATE_NATIVE"] = "0"  # this process imports the source it compiles

from gateway import native  # noqa: E402


def build(force: bool) -> int:
    before = native.fingerprint()
    if not force and native.STAMP.is_file() and native.STAMP.read_text().strip() == before \
            and native.extension_files():
        print(f"build_native: fresh, nothing to do ({native.BUILD_DIR})")
        return 0
    from mypyc.build import mypycify
    from setuptools import setup

    temp = ROOT / "build" / "native"
    shutil.rmtree(native.BUILD_DIR, ignore_errors=True)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    paths = [str(p.relative_to(ROOT)) for p in native.source_paths()]
    started = time.monotonic()
    os.chdir(ROOT)  # mypyc names modules by their path from here
    setup(
        name="kvgate-native",
        ext_modules=mypycify(paths, group_name=native.GROUP, target_dir=str(temp / "c"),
                             opt_level="3"),
        script_args=["--quiet", "build_ext", "--build-lib", str(native.BUILD_DIR),
                     "--build-temp", str(temp / "obj")],
    )
    if native.fingerprint() != before:
        print("build_native: the source changed while compiling; run it again", file=sys.stderr)
        return 1
    if not native.extension_files():
        print("build_native: extensions missing after the build", file=sys.stderr)
        return 1
    native.STAMP.write_text(before + "\n")
    print(f"build_native: {len(paths)} modules compiled into {native.BUILD_DIR} "
          f"in {time.monotonic() - started:.0f} s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="compile even when fresh")
    return build(parser.parse_args().force)


if __name__ == "__main__":
    raise SystemExit(main())
