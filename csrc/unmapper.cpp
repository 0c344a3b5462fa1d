// The unmap thread behind unmap_later(): one per process, started on first use, safe across fork.
#include "unmapper.hpp"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <new>
#include <thread>

namespace smstore {
namespace {

constexpr int kUnmapNiceness = 10;  // added to the process's nice value (the daemon's loader: the same)

struct Range {
    void* addr;
    size_t size;
};

struct Unmapper {
    std::mutex mu;                 // guards everything below
    std::condition_variable wake;  // the thread: a range was queued
    std::condition_variable idle;  // wait_for_unmaps(): the queue ran dry
    std::deque<Range> queue;
    bool busy = false;     // the thread is unmapping a range it took off the queue
    bool running = false;  // this process has the thread
};

Unmapper& state();

// fork() copies the queued ranges but not the thread: the child unmaps its copies itself. The
// parent waits for the range in flight, so none is half done (taken off the queue, still mapped)
// in the child, and the child gets a fresh mutex and condition variables: the old ones may record
// the parent's thread as a waiter, which the child does not have.
void before_fork() {
    Unmapper& u = state();
    std::unique_lock<std::mutex> lock(u.mu);
    u.idle.wait(lock, [&] { return !u.busy; });
    lock.release();  // held across fork(); let go in after_fork_*
}

void after_fork_in_parent() {
    state().mu.unlock();
}

void after_fork_in_child() {
    Unmapper& u = state();
    for (const Range& r : u.queue)
        ::munmap(r.addr, r.size);
    u.queue.clear();
    u.running = false;
    // The copies left behind are never destroyed: destroying a copied, locked mutex is undefined.
    new (&u.mu) std::mutex;
    new (&u.wake) std::condition_variable;
    new (&u.idle) std::condition_variable;
}

Unmapper& state() {
    // Never destroyed: the thread may still be waiting on it while the process exits.
    static Unmapper* u = [] {
        auto* made = new Unmapper;
        ::pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
        return made;
    }();
    return *u;
}

void run(Unmapper* u) {
    // Background work, below the threads that run Python (a rank's training loop, a worker's
    // reads), as the daemon's loader is: SCHED_BATCH never preempts the thread running when it
    // wakes, and nice +10 gives way on a busy core. Freeing a window's pages is milliseconds of
    // kernel time at a window switch; an idle core still does it at once. Linux applies both to
    // the calling thread alone. Best effort: where refused, the thread runs as it was started.
    ::pthread_setname_np(::pthread_self(), "smstore-unmap");  // for top -H, perf and the tests
    sched_param param{};
    ::sched_setscheduler(0, SCHED_BATCH, &param);
    errno = 0;
    int nice = ::getpriority(PRIO_PROCESS, 0);
    if (errno == 0) ::setpriority(PRIO_PROCESS, 0, std::min(nice + kUnmapNiceness, 19));
    std::unique_lock<std::mutex> lock(u->mu);
    for (;;) {
        u->wake.wait(lock, [&] { return !u->queue.empty(); });
        Range r = u->queue.front();
        u->queue.pop_front();
        u->busy = true;
        lock.unlock();
        ::munmap(r.addr, r.size);
        lock.lock();
        u->busy = false;
        u->idle.notify_all();  // before_fork() waits for !busy, wait_for_unmaps() for an empty queue too
    }
}

// Starts the thread with every signal blocked (signals are for the threads that run Python).
bool start_thread(Unmapper& u) noexcept {
    sigset_t all, old;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old);
    try {
        std::thread(run, &u).detach();
        u.running = true;
    } catch (const std::exception&) {  // no thread to be had: the caller unmaps inline
    }
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    return u.running;
}

}  // namespace

void unmap_later(void* addr, size_t size) noexcept {
    if (size < kBackgroundUnmapBytes) {
        ::munmap(addr, size);
        return;
    }
    Unmapper& u = state();
    std::lock_guard<std::mutex> lock(u.mu);
    try {
        if (u.running || start_thread(u)) {
            u.queue.push_back({addr, size});
            u.wake.notify_one();
            return;
        }
    } catch (const std::bad_alloc&) {
    }
    ::munmap(addr, size);
}

void wait_for_unmaps() noexcept {
    Unmapper& u = state();
    std::unique_lock<std::mutex> lock(u.mu);
    u.idle.wait(lock, [&] { return u.queue.empty() && !u.busy; });
}

}  // namespace smstore
