#pragma once
// quanta::dist in one include: stores, process groups and collectives,
// differentiable collectives, rank-consistent random streams, DataParallel
// and the launcher environment. See docs/dist.md.
#include "dist/data_parallel.h"
#include "dist/env.h"
#include "dist/functional.h"
#include "dist/optimizer_shards.h"
#include "dist/process_group.h"
#include "dist/random.h"
#include "dist/sharded_units.h"
#include "dist/store/store.h"
