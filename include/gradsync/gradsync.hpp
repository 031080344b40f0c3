#pragma once
// Everything a trainer needs: the Synchronizer and every policy this build ships.

#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/bucketing/per_tensor.hpp"
#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/launch/environment.hpp"
#include "gradsync/synchronizer.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/transport/in_process.hpp"
#include "gradsync/transport/tcp.hpp"
#include "gradsync/version.hpp"
