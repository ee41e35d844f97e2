// The model side of a load, in one pass: what each kept state-dict value
// takes (its checkpoint unit) and where this rank writes it (its local tensor
// and the global offset of the box it holds). Python keeps the key matching
// and words the messages with the keys.
#pragma once

#include <torch/extension.h>

#include <optional>

#include "dest_feed.h"
#include "id_table.h"

namespace coalesced_bcast {

namespace py = pybind11;

// The text that stands for a value's key in the messages load_dests returns.
constexpr const char* kKeyMark = "\x01key\x01";

// values: the model's state-dict values that key matching kept (parameters,
// buffers, DTensors); rows: int64 [n], each one's row of the source's table;
// table: int64 [R, 2 + kMaxDims] (dtype, ndim, sizes); canon_rows: int64 [R],
// per row the first row that is the same tensor (ties are one unit);
// owned_ids: the ids of the model's own parameters and buffers; the DTensor,
// Shard and Replicate types; mesh_facts(mesh) -> (is this rank in it, its
// coordinate on a 1-D mesh, ndim, size of a 1-D mesh), called once per mesh;
// nd_box(mesh, placements, shape) -> (problem or None, offset or None, local
// shape), for meshes of other than one dim; device: the model's (first_device;
// on a GPU group, the GPU where that is in host memory), which every local
// tensor with elements must be on, none on meta; on a CUDA device, pinned host
// memory too (written from the GPU: load_plan.cpp).
// A 0-dim model tensor takes a 1-dim checkpoint value of one element (torch
// 0.3's scalars), as load_state_dict does; with scalar_from_any_1dim, its
// first element of any length (as torch 2.4's load_state_dict does).
// Returns (local tensors as a TensorList (tensor_list.h), dest meta int64 [m, 1 + kMaxDims], units table
// int64 [U, 2 + kMaxDims], each unit's source row int64 [U], keys cast,
// [(value index, message with kKeyMark for its key)]). A tensor named by two
// keys is one destination that takes the last key's unit, in its first key's
// place (as a dict keeps it). feed: where each destination is put instead, as it
// is found, for a plan made meanwhile (dest_feed.h; the local tensors returned are
// then none: PendingPlan.dests() has them); a tensor named twice spoils it.
py::tuple load_dests(
    const py::list& values,
    const at::Tensor& rows,
    const at::Tensor& table,
    const at::Tensor& canon_rows,
    const IdSet& owned_ids,
    const py::handle& dtensor_type,
    const py::handle& shard_type,
    const py::handle& replicate_type,
    const py::function& mesh_facts,
    const py::function& nd_box,
    c10::Device device,
    int64_t rank,
    bool scalar_from_any_1dim,
    DestFeed* feed = nullptr);

// The device of the first tensor among `values` (DTensors: their local
// tensors) that has elements or is on the meta device, and its index; (none,
// -1) if there is none. load_dests checks every loaded tensor against it: a
// pass over the values of its own cost as much as a key's checks there.
// `values`: any iterable (a dict's values), read only up to that tensor.
std::tuple<std::optional<c10::Device>, int64_t> first_device(const py::iterable& values,
                                                             const py::handle& dtensor_type);

}  // namespace coalesced_bcast
