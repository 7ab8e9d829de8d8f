#pragma once
// The device a run's --device names (train, both tasks, and finetune), with
// one clear error when this build or this machine cannot give it.
#include <string>

#include "engine/device.h"

namespace quanta::train {

/** "cpu", "cuda", "cuda:N", "sim" or "sim:N" as a Device, for a process
 * whose launcher gave it `local_rank` (its place among the ranks of its
 * node; see rank_device). Throws std::invalid_argument naming --device and
 * the value when it is none of those, when this quanta was built without
 * CUDA, or when the GPU it names is not visible. */
Device run_device(const std::string& value, int local_rank);
/** The same, the local rank read from the launcher's environment
 * (dist::launch_info_from_env: LOCAL_RANK, SLURM_LOCALID,
 * OMPI_COMM_WORLD_LOCAL_RANK; 0 without a launcher). */
Device run_device(const std::string& value);

/** `parsed` (Device::parse of `value`) for the rank at `local_rank`: a bare
 * "cuda" is the GPU of that number, as torchrun's convention has it, so the
 * ranks of a node spread over its GPUs (NCCL needs one GPU per rank);
 * "cuda:N", a CPU and a sim device are what they name on every rank. */
Device rank_device(const std::string& value, Device parsed, int local_rank);

}  // namespace quanta::train
