// tools/idemctl/table.cpp — column-aligned tables (see table.hpp).
#include "table.hpp"

#include "text.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <ostream>

namespace idemctl {

void print_table(std::ostream& out, const std::vector<std::string>& header,
                 const std::vector<std::vector<std::string>>& rows) {
    std::vector<std::size_t> width(header.size());
    for (std::size_t c = 0; c < header.size(); ++c) width[c] = display_width(header[c]);
    for (const auto& row : rows) {
        for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], display_width(row[c]));
    }
    const auto line = [&](const std::vector<std::string>& cells) {
        std::string s;
        for (std::size_t c = 0; c < cells.size(); ++c) {
            s += cells[c];
            if (c + 1 < cells.size()) s.append(width[c] - display_width(cells[c]) + 2, ' ');
        }
        out << s << '\n';
    };
    line(header);
    for (const auto& row : rows) line(row);
}

std::string Cells::operator()(std::string_view bytes) {
    if (wide_) return printable(bytes);
    bool cut = false;
    std::string text = printable_cut(bytes, kMostColumns, cut);
    any_cut_ = any_cut_ || cut;
    return text;
}

void Cells::note(std::ostream& out) const {
    if (!any_cut_) return;
    out << fmt::format(
        "(a value wider than {} columns is cut short with …: --wide prints it whole, as --json "
        "always does)\n",
        kMostColumns);
}

}  // namespace idemctl
