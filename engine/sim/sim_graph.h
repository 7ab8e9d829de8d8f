#pragma once
// sim's graphs (DeviceGraph, engine/capture/device_graph.h): a recording is
// the closures sim's table would have queued (engine/sim/queued.h keeps each
// call's arguments by value), posted again as one job per replay. Memory
// allocated while recording belongs to the graph: freed by the host, it is
// kept until the graph is destroyed, because every replay writes it again.
// Internal to the sim device.
#include <cstddef>

#include "engine/device_backend.h"

namespace quanta::sim {

/** The GraphOps of sim's DeviceBackend. */
const GraphOps& graph_ops();

/** allocate() calls this: memory made while device `index` records
 * belongs to the recording. */
void note_allocation(void* ptr, int index);
/** release() calls this first: true when a graph owns `ptr`, which then
 * keeps it (and counts its release) until the graph is destroyed. */
bool kept_by_graph(void* ptr, std::size_t nbytes);

}  // namespace quanta::sim
