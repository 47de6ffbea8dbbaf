// How a checkpoint records where a saved partition's elements sit in the flat parameter layout
// (zero/shard_map.h): the optim_states file of each rank carries "shard_pieces" ([[flat_begin,
// length, offset], ...]; the partition's length is the master's). Files written before the
// pieces existed hold contiguous partitions (rank r: [r*P, (r+1)*P), P = the master's length).
#pragma once

#include <vector>

#include "runtime/checkpoint/tensor_file.h"
#include "zero/shard_map.h"

namespace strata::checkpoint {

json pieces_json(const std::vector<zero::ShardPiece>& pieces);
// The pieces of the partition in `file`, saved by rank `rank`.
std::vector<zero::ShardPiece> saved_pieces(const TensorFile& file, int rank);
// The map the saved partitions were cut by; files[r] is rank r's optim_states.
zero::ShardMap saved_shard_map(const std::vector<TensorFile>& files);

}  // namespace strata::checkpoint
