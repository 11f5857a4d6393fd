# Sourced, after scripts/lib/check.sh, by the GPU scripts that run what scripts/gpu-stage-read.sh
# staged in .gpu/read/: the staged daemon and consumer for the tests and benchmarks, scratch space on
# the local disk, unbuffered Python output, and the udev entry cuFile needs on this VM.
export PYTHONUNBUFFERED=1 TMPDIR=/var/tmp
bin="$PWD/.gpu/read/bin"
export GPUFEED_BIN="$bin/gpufeed" GPUFEED_CONSUME_BIN="$bin/consume"
cufile_udev_entry
