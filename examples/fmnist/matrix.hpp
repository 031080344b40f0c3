#pragma once
// Eigen views of the models' std::vector storage, for their matrix products: row-major, so a
// sample's values (or a weight row) are one row, as the vectors hold them.

#include <Eigen/Core>

namespace fmnist::matrix {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<Matrix>;
using ConstMap = Eigen::Map<const Matrix>;
using RowMap = Eigen::Map<Eigen::RowVectorXf>;
using ConstRowMap = Eigen::Map<const Eigen::RowVectorXf>;
using ColumnMap = Eigen::Map<Eigen::VectorXf>;
using ConstColumnMap = Eigen::Map<const Eigen::VectorXf>;

}  // namespace fmnist::matrix
