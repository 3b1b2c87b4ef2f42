// Downstream consumer of an installed idem: only the public header and idem::idem are used.
#include <idem/idem.hpp>

#include <cstdio>
#include <string_view>

int main() {
    idem::MemoryStore store;
    const idem::Key key{"scope", "value"};
    const auto fp = idem::fingerprint(std::string_view{"a"}, 1);

    const auto result = idem::execute_once(store, key, fp, [] { return idem::Response{201, "ok"}; });
    if (result.outcome() != idem::Outcome::executed) {
        std::fprintf(stderr, "idem consumer: unexpected outcome\n");
        return 1;
    }
    std::puts("idem consumer: ok");
    return 0;
}
