# Source on the GPU machine: makes `repack`, `repack.runtime`, `repack.formats` importable from this checkout
# without pip (the machine has torch and triton but no network).
PKG=/tmp/repack-pkg
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r repack "$PKG/repack" && cp -r runtime "$PKG/repack/runtime" && cp -r formats "$PKG/repack/formats"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
