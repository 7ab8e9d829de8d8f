#pragma once
// Eigen's dense decompositions (QR, SVD) under engine/eigen.h's silenced
// warnings, for the host-side decompositions of engine/ops (qr.cpp,
// svd.cpp): include this, never <Eigen/QR> or <Eigen/SVD> directly.
#include "engine/eigen.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/QR>
#include <Eigen/SVD>
#pragma GCC diagnostic pop
