// How a checkpoint records where a saved partition's elements sit in the flat parameter layout
// (zero/shard_map.h): the optim_states file of each rank carries "shard_pieces" ([[flat_begin,
// length, offset], ...]; the partition's length is the master's). Files written before the
// pieces existed hold contiguous partitions (rank r: [r*P, (r+1)*P), P = the master's length).
//
// Pieces come from a file, so they are checked before anything is cut by them: each lies inside
// its partition, no two overlap (in the flat layout or in a partition), and together they cover
// the flat layout [0, flat_numel) (past it, padding). What they assemble is then bounded by the
// partitions the files hold.
#pragma once

#include <string>
#include <vector>

#include "runtime/checkpoint/tensor_file.h"
#include "zero/shard_map.h"

namespace strata::checkpoint {

json pieces_json(const std::vector<zero::ShardPiece>& pieces);
// The pieces of the partition in `file`, saved by rank `rank`, each inside the file's "master".
// Footers (TensorFileInfo) are enough: the pieces and the master's length are in them.
std::vector<zero::ShardPiece> saved_pieces(const TensorFileInfo& file, int rank);
std::vector<zero::ShardPiece> saved_pieces(const TensorFile& file, int rank);
// The map the saved partitions were cut by; files[r] is rank r's optim_states. Every file's
// master has one length, and the pieces cover the "flat_numel" the files record.
zero::ShardMap saved_shard_map(const std::vector<TensorFileInfo>& files);
zero::ShardMap saved_shard_map(const std::vector<TensorFile>& files);
// What a loaded file's footer said (its tensors' specs and its scalars).
TensorFileInfo info_of(const TensorFile& file);

// Pieces read from `paths[r]` (partition length partition_numel[r]): each inside its partition
// without overflow, none overlapping another, together covering [0, flat_numel). With
// `past_end` false, no piece may reach past flat_numel either. Throws strata::Error naming the
// file.
void check_pieces(const std::vector<std::vector<zero::ShardPiece>>& per_rank,
                  const std::vector<int64_t>& partition_numel, int64_t flat_numel, bool past_end,
                  const std::vector<std::string>& paths);
// The integer [a, b, c] triples of `list` (a file's "shard_pieces" or "expert_pieces").
std::vector<zero::ShardPiece> pieces_from_json(const json& list, const std::string& key,
                                               const std::string& path);

}  // namespace strata::checkpoint
