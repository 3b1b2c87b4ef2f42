#include "util.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
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
