// The layout report of `mpigpt train --dry-run`: for a config and a world size, which rank
// holds which layers and which ranks it shares each group with, computed without training.
#pragma once
#include <string>

#include "io/config/config.h"

namespace mpigpt {

std::string layout_report(const Config& cfg, int world);

}  // namespace mpigpt
