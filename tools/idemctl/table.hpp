// tools/idemctl/table.hpp — the column-aligned tables of list and reconcile-report.
//
// Cells are printable text (text.hpp), padded by the columns a terminal gives them, not by their
// bytes. A stored scope, key or phase is cut to kMostColumns unless --wide: a 255-byte key would
// push every other column off the screen; the table then says so under it.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

namespace idemctl {

/// The widest a stored value is shown in a table's column unless --wide.
inline constexpr std::size_t kMostColumns = 40;

/// Writes `header` and `rows` (printable cells), each column as wide as its widest cell plus two
/// spaces; the last column is not padded.
void print_table(std::ostream& out, const std::vector<std::string>& header,
                 const std::vector<std::vector<std::string>>& rows);

/// Makes stored bytes a table's cell: printable, and cut to kMostColumns unless `wide`.
class Cells {
public:
    explicit Cells(bool wide) : wide_(wide) {}

    /// printable(bytes), cut short with "…" when wider than kMostColumns (and not wide).
    [[nodiscard]] std::string operator()(std::string_view bytes);

    /// When a cell was cut: one line saying so and how to see the values whole.
    void note(std::ostream& out) const;

private:
    bool wide_;
    bool any_cut_ = false;
};

}  // namespace idemctl
