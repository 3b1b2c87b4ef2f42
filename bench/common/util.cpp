#include "util.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace bench {

std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start <= s.size()) {
        const auto comma = s.find(',', start);
        const auto end = comma == std::string::npos ? s.size() : comma;
        if (end > start) out.push_back(s.substr(start, end - start));
        start = end + 1;
    }
    return out;
}

bool Args::next() {
    if (started_) ++i_;
    started_ = true;
    if (i_ >= args_.size()) return false;
    name_ = args_[i_];
    inline_value_.reset();
    if (const auto eq = name_.find('='); name_.rfind("--", 0) == 0 && eq != std::string::npos) {
        inline_value_ = name_.substr(eq + 1);
        name_.resize(eq);
    }
    return true;
}

std::string Args::value() {
    if (inline_value_) return *inline_value_;
    if (i_ + 1 >= args_.size()) {
        std::fprintf(stderr, "idem-bench: %s needs a value\n", name_.c_str());
        usage_(2);
        std::exit(2);
    }
    return args_[++i_];
}

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

ChildRun run_child(const std::vector<std::string>& argv, bool merge_stderr) {
    ChildRun run;
    int fds[2];
    if (argv.empty() || ::pipe(fds) != 0) {
        run.status = -1;
        run.output = "pipe failed";
        return run;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid < 0) {
        ::close(fds[0]);
        ::close(fds[1]);
        run.status = -1;
        run.output = "fork failed";
        return run;
    }
    if (pid == 0) {
        ::close(fds[0]);
        if (::dup2(fds[1], STDOUT_FILENO) < 0 || (merge_stderr && ::dup2(fds[1], STDERR_FILENO) < 0)) ::_exit(127);
        ::close(fds[1]);
        std::vector<char*> args;
        for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
        ::execv(args[0], args.data());
        std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
        ::_exit(127);
    }
    ::close(fds[1]);
    char buf[4096];
    for (;;) {
        const ssize_t n = ::read(fds[0], buf, sizeof buf);
        if (n > 0) {
            run.output.append(buf, static_cast<std::size_t>(n));
        } else if (n == 0 || errno != EINTR) {
            break;
        }
    }
    ::close(fds[0]);
    while (::wait4(pid, &run.status, 0, &run.usage) < 0 && errno == EINTR) {
    }
    return run;
}

}  // namespace bench
