// The launcher's pure parts: hostfile and DeepSpeed's filter semantics, --world-info, the
// command line and merge(), line prefixing, shell quoting, the /proc process table.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>

#include "launcher/hostfile.h"
#include "launcher/line_prefixer.h"
#include "launcher/options.h"
#include "launcher/process_table.h"
#include "launcher/ssh.h"

namespace strata::launcher {
namespace {

std::string text(const Resources& r) { return format_world_info(r); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

const Resources kPool = parse_hostfile_text("worker-0 slots=4\nworker-1 slots=4\n", "test");

TEST(Hostfile, ParsesSlotsCommentsAndBlankLines) {
  Resources r = parse_hostfile_text("# head\n\n  a slots=2 # two\nb\tslots=1\n", "hf");
  EXPECT_EQ(text(r), "a:0,1@b:0");
  EXPECT_NE(
      error_of([] { parse_hostfile_text("a slots=2\nb\n", "hf"); }).find("hf line 2: no slots=N"),
      std::string::npos);
  EXPECT_NE(error_of([] {
              parse_hostfile_text("a slots=2 max_slots=4\n", "hf");
            }).find("line 1: unexpected 'max_slots=4'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hostfile_text("a slots=0\n", "hf"); }).find("at least 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_hostfile_text("-oProxyCommand=x slots=1\n", "hf");
            }).find("cannot start with '-'"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { parse_hostfile_text("# only a comment\n", "hf"); }).find("names no hosts"),
      std::string::npos);
}

// Hosts as ssh takes them (issue #17): USER@HOST and IPv6 literals pass, and travel in
// --world-info and --include by their machine, IPv6 in brackets; what ssh would not take fails
// here, naming the line, not on the remote side.
TEST(Hostfile, TakesUserAtHostAndIpv6AsSshDoes) {
  Resources r = parse_hostfile_text(
      "alice@node1 slots=2\n[fe80::1] slots=1\n2001:db8::5 slots=1\nbob@[::2] slots=1\n", "hf");
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].host, "alice@node1");
  EXPECT_EQ(r[1].host, "fe80::1");
  EXPECT_EQ(r[2].host, "2001:db8::5");
  EXPECT_EQ(r[3].host, "bob@::2");
  EXPECT_EQ(text(r), "node1:0,1@[fe80::1]:0@[2001:db8::5]:0@[::2]:0");
  EXPECT_EQ(text(parse_world_info(text(r))), text(r));
  EXPECT_EQ(text(filter_resources(r, "node1:1@[fe80::1]", "")), "node1:1@[fe80::1]:0");
  EXPECT_EQ(text(filter_resources(r, "", "[2001:db8::5]@node1:0")), "node1:1@[fe80::1]:0@[::2]:0");
  EXPECT_NE(error_of([&] { filter_resources(r, "fe80::1:0", ""); }).find("in brackets"),
            std::string::npos);
  for (const char* bad : {"a/b slots=1\n", "a@b@c slots=1\n", "a;b slots=1\n", "@a slots=1\n"})
    EXPECT_NE(error_of([&] { parse_hostfile_text(bad, "hf"); }).find("hf line 1: '"),
              std::string::npos)
        << bad;
  EXPECT_NE(error_of([] {
              parse_hostfile_text("alice@n slots=1\nbob@n slots=1\n", "hf");
            }).find("line 2: host 'n' is listed twice (also as 'alice@n')"),
            std::string::npos);
}

// The examples of DeepSpeed's parse_resource_filter docstring and its tests.
TEST(Filter, FollowsDeepSpeedSemantics) {
  EXPECT_EQ(text(filter_resources(kPool, "worker-0@worker-1:0,2", "")),
            "worker-0:0,1,2,3@worker-1:0,2");
  EXPECT_EQ(text(filter_resources(kPool, "", "worker-1:0")), "worker-0:0,1,2,3@worker-1:1,2,3");
  EXPECT_EQ(text(filter_resources(kPool, "", "worker-0")), "worker-1:0,1,2,3");
  EXPECT_EQ(text(filter_resources(kPool, "worker-1:0", "")), "worker-1:0");
  EXPECT_EQ(text(filter_resources(kPool, "worker-1:3,1", "")), "worker-1:3,1");  // order kept
  EXPECT_EQ(text(filter_resources(kPool, "worker-1@worker-0:1", "")),
            "worker-0:1@worker-1:0,1,2,3");
  EXPECT_EQ(text(filter_resources(kPool, "worker-0:1,1", "")), "worker-0:1");
  EXPECT_EQ(text(filter_resources(kPool, "", "")), text(kPool));
  EXPECT_NE(error_of([] { filter_resources(kPool, "worker-2", ""); }).find("host 'worker-2'"),
            std::string::npos);
  EXPECT_NE(error_of([] { filter_resources(kPool, "worker-0:4", ""); }).find("slot 4"),
            std::string::npos);
  EXPECT_NE(error_of([] { filter_resources(kPool, "a", "b"); }).find("mutually exclusive"),
            std::string::npos);
  EXPECT_NE(error_of([] { filter_resources(kPool, "worker-0:", ""); }).find("slot ''"),
            std::string::npos);
  EXPECT_NE(error_of([] { filter_resources(kPool, "worker-0:1:2", ""); }).find("bad node"),
            std::string::npos);
}

TEST(WorldInfo, RoundTripsAndNeedsSlots) {
  EXPECT_EQ(text(parse_world_info("a:0,1@b:3")), "a:0,1@b:3");
  EXPECT_NE(error_of([] { parse_world_info("a:0@b"); }).find("host 'b' has no slot list"),
            std::string::npos);
}

TEST(Options, AcceptsTorchrunAndDeepSpeedSpellings) {
  auto o =
      *parse_command_line({"--nproc_per_node", "4", "--nnodes=2", "--node-rank", "1",
                           "--master_addr", "h", "--master-port=123", "-H", "hf", "prog", "--x"});
  EXPECT_EQ(o.num_gpus, 4);
  EXPECT_EQ(o.num_nodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "h");
  EXPECT_EQ(o.master_port, 123);
  EXPECT_EQ(o.hostfile, "hf");
  EXPECT_EQ(o.program, (std::vector<std::string>{"prog", "--x"}));  // the first word ends options
  o = *parse_command_line({"--num_gpus", "2", "--num_nodes", "3", "--", "--odd-program"});
  EXPECT_EQ(o.num_gpus, 2);
  EXPECT_EQ(o.num_nodes, 3);
  EXPECT_EQ(o.program, std::vector<std::string>{"--odd-program"});
  EXPECT_THROW(parse_command_line({"--nproc-per-node", "0", "--", "p"}), UsageError);
  EXPECT_THROW(parse_command_line({"--master-port"}), UsageError);
  EXPECT_THROW(parse_command_line({"--dry-run=yes", "p"}), UsageError);
}

TEST(Options, CommandLineOverridesTheConfigBlock) {
  LauncherOptions cli, config;
  cli.num_gpus = 2;
  cli.exports = {"A=cli"};
  cli.program = {"train"};
  config.num_gpus = 8;
  config.num_nodes = 4;
  config.include = "a";
  config.hostfile = "hosts";
  config.hostfile_named_by = "launcher.hostfile of c.json";
  config.master_port = 1234;
  config.exports = {"A=config", "B=config"};
  LauncherOptions m = merge(cli, config);
  EXPECT_EQ(m.num_gpus, 2);
  EXPECT_EQ(m.num_nodes, 4);
  EXPECT_EQ(m.hostfile, "hosts");
  EXPECT_EQ(m.hostfile_named_by, "launcher.hostfile of c.json");
  EXPECT_EQ(m.master_port, 1234);
  EXPECT_FALSE(m.include);  // a count on the command line replaces the block's filter
  EXPECT_EQ(m.exports, (std::vector<std::string>{"A=config", "B=config", "A=cli"}));  // last wins
  EXPECT_EQ(m.program, std::vector<std::string>{"train"});

  // A filter on the command line replaces the block's whole choice of slots (issue #17: the
  // block's num_gpus made --include an error).
  LauncherOptions filter;
  filter.exclude = "b";
  m = merge(filter, config);
  EXPECT_EQ(m.exclude, "b");
  EXPECT_FALSE(m.include);
  EXPECT_FALSE(m.num_gpus);
  EXPECT_FALSE(m.num_nodes);
  filter.hostfile = "mine";
  EXPECT_EQ(merge(filter, config).hostfile_named_by, "");  // the command line's own hostfile
}

TEST(Options, SshOptionsAndTheirSpellings) {
  auto o = *parse_command_line({"--ssh_port", "2222", "--ssh-config", "cfg",
                                "--ssh-connect-timeout=3", "prog"});
  EXPECT_EQ(o.ssh_port, 2222);
  EXPECT_EQ(o.ssh_config, "cfg");
  EXPECT_EQ(o.ssh_connect_timeout, 3);
  EXPECT_THROW(parse_command_line({"--ssh-connect-timeout", "0", "p"}), UsageError);
  EXPECT_EQ(ssh_argv("u@h", "cmd", SshOptions{"cfg", 2222, 3}),
            (std::vector<std::string>{"ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3",
                                      "-F", "cfg", "-p", "2222", "u@h", "cmd"}));
}

TEST(LinePrefixer, EmitsWholePrefixedLinesAndFlushesThePartialOne) {
  LinePrefixer p("[rank 1] ");
  EXPECT_EQ(p.feed("a\nb"), "[rank 1] a\n");
  EXPECT_EQ(p.feed("c\n\nd"), "[rank 1] bc\n[rank 1] \n");
  EXPECT_EQ(p.flush(), "[rank 1] d\n");
  EXPECT_EQ(p.flush(), "");
  std::string longer(LinePrefixer::kMaxLine + 5, 'x');
  std::string out = p.feed(longer);
  EXPECT_EQ(out, "[rank 1] " + std::string(LinePrefixer::kMaxLine, 'x') + "\n");
  EXPECT_EQ(p.flush(), "[rank 1] xxxxx\n");
}

TEST(Shell, QuotesOnlyWhatNeedsIt) {
  EXPECT_EQ(shell_quote("/bin/echo"), "/bin/echo");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(remote_command({"x", "y z"}), "exec x 'y z'");
}

// The variables a node launcher reads from its stdin (issue 35): values with newlines,
// backslashes and '=' come back intact; what follows the block stays unread.
TEST(Shell, EnvBlockRoundTripsThroughAPipe) {
  const EnvList env = {{"A", "1"}, {"B", "two\nlines \\n and \\"}, {"C", "x=y"}, {"D", ""}};
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string text = env_block(env) + "stop 15\n";
  ASSERT_EQ(::write(fds[1], text.data(), text.size()), static_cast<ssize_t>(text.size()));
  EXPECT_EQ(read_env_block(fds[0], 5), env);
  char rest[16] = {};
  EXPECT_EQ(::read(fds[0], rest, sizeof rest), 8);
  EXPECT_EQ(std::string(rest), "stop 15\n");
  ::close(fds[1]);
  try {
    read_env_block(fds[0], 5);
    ADD_FAILURE() << "no error at end of file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stdin closed before the block of variables ended"),
              std::string::npos)
        << e.what();
  }
  ::close(fds[0]);
}

TEST(ProcessTable, ReadsStateParentAndGroupPastAnOddCommandName) {
  ProcessInfo p;
  ASSERT_TRUE(parse_proc_stat("42 (a) b (c) Z 7 9 9 0 -1 4194560\n", p));
  EXPECT_EQ(p.pid, 42);
  EXPECT_EQ(p.state, 'Z');
  EXPECT_EQ(p.ppid, 7);
  EXPECT_EQ(p.pgrp, 9);
  EXPECT_TRUE(p.dead());
  EXPECT_FALSE(parse_proc_stat("42 (a", p));
  const std::vector<ProcessInfo> table = list_processes();
  auto self = std::find_if(table.begin(), table.end(),
                           [](const ProcessInfo& q) { return q.pid == ::getpid(); });
  ASSERT_NE(self, table.end());
  EXPECT_EQ(self->ppid, ::getppid());
  EXPECT_EQ(self->pgrp, ::getpgrp());
  EXPECT_FALSE(self->dead());
}

}  // namespace
}  // namespace strata::launcher
