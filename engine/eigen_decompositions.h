#pragma once
// Eigen's dense decompositions (LU, QR, SVD) under engine/eigen.h's silenced
// warnings, for the host-side decompositions (engine/ops' qr.cpp and
// svd.cpp, quant/nf4's CorDA start): include this, never <Eigen/LU>,
// <Eigen/QR> or <Eigen/SVD> directly.
#include "engine/eigen.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/LU>
#include <Eigen/QR>
#include <Eigen/SVD>
#pragma GCC diagnostic pop
