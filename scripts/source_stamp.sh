#!/usr/bin/env bash
# What a build of the extension reads, hashed: setup.py and csrc/ (file names and contents, sorted).
# prebuild_device.sh records it with the torch it built against; device_run.sh's build step compares.
cd "$(dirname "$0")/.."
for f in setup.py $(ls csrc | LC_ALL=C sort | sed 's|^|csrc/|'); do echo "$f"; cat "$f"; done | sha256sum | cut -d' ' -f1
