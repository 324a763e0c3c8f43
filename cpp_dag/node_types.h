// Factories of the node types, one per node_*.cpp file.
#pragma once

#include <memory>

#include "dag.h"

namespace slmrank {

std::unique_ptr<Node> make_score_masks(const NodeSpec& spec);
std::unique_ptr<Node> make_beam_masks(const NodeSpec& spec);
std::unique_ptr<Node> make_beam_state(const NodeSpec& spec);
std::unique_ptr<Node> make_embedding(const NodeSpec& spec);
std::unique_ptr<Node> make_decoder_layer(const NodeSpec& spec);
std::unique_ptr<Node> make_rms_norm(const NodeSpec& spec);
std::unique_ptr<Node> make_gather_rows(const NodeSpec& spec);
std::unique_ptr<Node> make_lm_head(const NodeSpec& spec);
std::unique_ptr<Node> make_cls_head(const NodeSpec& spec);
std::unique_ptr<Node> make_label_logprobs(const NodeSpec& spec);
std::unique_ptr<Node> make_beam_init(const NodeSpec& spec);
std::unique_ptr<Node> make_beam_step(const NodeSpec& spec);
std::unique_ptr<Node> make_beam_allowed(const NodeSpec& spec);
std::unique_ptr<Node> make_beam_hold(const NodeSpec& spec);

}  // namespace slmrank
