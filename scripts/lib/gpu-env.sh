# Sourced by every scripts/gpu-*.sh that runs on the GPU machine: the CUDA libraries and tools on the
# search paths, and `cufile_udev_entry`, which writes the udev entry cuFile needs on this VM (the root
# disk has no udev record, so cuFile's driver-less registration fails without it; see
# shared/GPU_MACHINE.md). Scripts that test the fallback without the entry call it after that test.

export LD_LIBRARY_PATH="/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="/usr/local/cuda/bin:$PATH"

cufile_udev_entry() {
  mkdir -p /run/udev/data
  printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\nE:DEVTYPE=disk\n' >/run/udev/data/b254:0
}
