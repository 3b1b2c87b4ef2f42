#include "util.hpp"

#include <fstream>
#include <sstream>

namespace bench {

Memory memory_now() {
    Memory m;
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
        const auto read_kb = [&](const char* prefix, double& out) {
            if (line.rfind(prefix, 0) == 0) {
                std::istringstream in(line.substr(std::string(prefix).size()));
                double kb = 0;
                in >> kb;
                out = kb / 1024.0;
            }
        };
        read_kb("VmRSS:", m.rss_mb);
        read_kb("VmHWM:", m.peak_mb);
    }
    return m;
}

}  // namespace bench
