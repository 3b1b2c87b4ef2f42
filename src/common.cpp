#include "common.hpp"

#include <openssl/rand.h>

#include <cstdint>
#include <cstring>

#include "idem/errors.hpp"

namespace idem::detail {

Fence new_fence() {
    for (;;) {
        std::uint64_t v = 0;
        if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof v) != 1) {
            throw error("idem: RAND_bytes failed; cannot make a fence token");
        }
        v &= 0x7FFFFFFFFFFFFFFFull;  // fits PostgreSQL bigint, stays positive
        if (v != 0) return static_cast<Fence>(v);
    }
}

}  // namespace idem::detail
