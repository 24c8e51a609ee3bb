#include "allreduce_algorithm.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "mpi_backend.h"

namespace kerasdist {
namespace {

constexpr char kVariable[] = "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM";
constexpr char kRingItem[] = "ring";

// The value of the item named `wanted` of `items`, or false when it has none.
bool FindItem(MPI_T_enum items, const char* wanted, int* value) {
  int count = 0;
  char name[256];
  int name_length = sizeof(name);
  if (MPI_T_enum_get_info(items, &count, name, &name_length) != MPI_SUCCESS) return false;
  for (int i = 0; i < count; ++i) {
    int item_value = 0;
    name_length = sizeof(name);
    if (MPI_T_enum_get_item(items, i, &item_value, name, &name_length) != MPI_SUCCESS) continue;
    if (std::strcmp(name, wanted) == 0) {
      *value = item_value;
      return true;
    }
  }
  return false;
}

// MPICH 5.0 gives its algorithm variables no MPI_T enum: their description lists the values, one
// "name - what it does" line each after a first line of its own, and MPICH numbers them in that
// order from 0 (the C enum it generates from the same list). The value of `wanted` in that list,
// or false when the description is not such a list starting with auto.
bool FindListedItem(const std::string& description, const char* wanted, int* value) {
  std::istringstream lines(description);
  std::string line;
  std::getline(lines, line);  // what the variable is for
  int position = 0;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string item, dash;
    if (!(words >> item >> dash) || dash != "-") return false;
    if (position == 0 && item != "auto") return false;
    if (item == wanted) {
      *value = position;
      return true;
    }
    ++position;
  }
  return false;
}

// A handle on the variable and its ring value, when this MPI has a writable integer variable of
// that name with a `ring` value, looked up by name: its number is MPICH's to change. MPI_T stays
// initialized (and the handle allocated) until MPI_Finalize.
bool FindRing(MPI_T_cvar_handle* handle, int* ring_value) {
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return false;
  int index = -1;
  char name[256];
  std::vector<char> description(16384);
  int name_length = sizeof(name), description_length = static_cast<int>(description.size());
  int verbosity = 0, bind = 0, scope = 0, count = 0, held = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_T_enum items = MPI_T_ENUM_NULL;
  bool found = MPI_T_cvar_get_index(kVariable, &index) == MPI_SUCCESS &&
               MPI_T_cvar_get_info(index, name, &name_length, &verbosity, &type, &items, description.data(),
                                   &description_length, &bind, &scope) == MPI_SUCCESS &&
               type == MPI_INT && bind == MPI_T_BIND_NO_OBJECT && scope != MPI_T_SCOPE_CONSTANT &&
               scope != MPI_T_SCOPE_READONLY &&
               (items != MPI_T_ENUM_NULL ? FindItem(items, kRingItem, ring_value)
                                         : FindListedItem(description.data(), kRingItem, ring_value));
  if (found) {
    found = MPI_T_cvar_handle_alloc(index, nullptr, handle, &count) == MPI_SUCCESS;
    // One value, and writing it back works: later writes around each call will too.
    if (found && !(count == 1 && MPI_T_cvar_read(*handle, &held) == MPI_SUCCESS &&
                   MPI_T_cvar_write(*handle, &held) == MPI_SUCCESS)) {
      MPI_T_cvar_handle_free(handle);
      found = false;
    }
  }
  if (!found) MPI_T_finalize();
  return found;
}

}  // namespace

Status AllreduceAlgorithm::Make(MPI_Comm comm, AllreduceChoice choice, AllreduceAlgorithm* algorithm) {
  AllreduceAlgorithm made;
  made.choice_ = choice;
  made.tuned_ = choice;
  made.ring_available_ = FindRing(&made.handle_, &made.ring_value_);
  MPI_Comm host;
  int code = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
  if (code != MPI_SUCCESS) return MpiStatus(code, "counting the hosts", "(start)");
  int host_rank = 0, host_size = 1;
  MPI_Comm_rank(host, &host_rank);
  MPI_Comm_size(host, &host_size);
  // Minima over the ranks: a choice and its negation give the least and the greatest choice,
  // a host size and its negation the smallest and the largest host.
  const int choice_number = static_cast<int>(choice);
  int least[5] = {made.ring_available_ ? 1 : 0, choice_number, -choice_number, host_size, -host_size};
  int hosts = host_rank == 0 ? 1 : 0;
  code = MPI_Allreduce(MPI_IN_PLACE, least, 5, MPI_INT, MPI_MIN, comm);
  if (code == MPI_SUCCESS) code = MPI_Allreduce(MPI_IN_PLACE, &hosts, 1, MPI_INT, MPI_SUM, comm);
  if (code != MPI_SUCCESS) {
    MPI_Comm_free(&host);
    return MpiStatus(code, "counting the hosts", "(start)");
  }
  if (least[1] != -least[2]) {
    MPI_Comm_free(&host);
    return Status::InvalidArgument(std::string("kerasdist: KERASDIST_ALLREDUCE_ALGORITHM differs between ranks (") +
                                   AllreduceChoiceName(static_cast<AllreduceChoice>(least[1])) + " and " +
                                   AllreduceChoiceName(static_cast<AllreduceChoice>(-least[2])) +
                                   "); set it alike on every rank, or leave it to kerasdist-run, which forwards it");
  }
  // A rank whose MPI lacks the variable keeps MPI's choice, so every rank does.
  made.ring_available_ = least[0] == 1;
  MPI_Comm_size(comm, &made.ranks_);
  made.hosts_ = hosts;
  made.ranks_per_host_ = least[3] == -least[4] ? least[3] : 0;
  // Decided from values every rank agreed on above, so every rank makes the communicators or none.
  const bool hierarchy = (choice == AllreduceChoice::kAuto || choice == AllreduceChoice::kHierarchical) &&
                         made.hosts_ >= 2 && made.ranks_per_host_ >= 2;
  if (!hierarchy) {
    MPI_Comm_free(&host);
    *algorithm = made;
    return Status::OK();
  }
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm across;
  code = MPI_Comm_split(comm, host_rank, rank, &across);
  if (code != MPI_SUCCESS) {
    MPI_Comm_free(&host);
    return MpiStatus(code, "making the communicator across hosts", "(start)");
  }
  MPI_Comm_set_errhandler(host, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(across, MPI_ERRORS_RETURN);
  // Every rank's host (named by its lowest rank until numbered below) and rank within it.
  int place[2] = {rank, host_rank};
  code = MPI_Allreduce(MPI_IN_PLACE, &place[0], 1, MPI_INT, MPI_MIN, host);
  std::vector<int> places(2 * static_cast<size_t>(made.ranks_));
  if (code == MPI_SUCCESS) code = MPI_Allgather(place, 2, MPI_INT, places.data(), 2, MPI_INT, comm);
  if (code != MPI_SUCCESS) {
    MPI_Comm_free(&host);
    MPI_Comm_free(&across);
    return MpiStatus(code, "finding where the ranks are", "(start)");
  }
  std::vector<int> lowest_ranks;
  for (int r = 0; r < made.ranks_; ++r) {
    if (places[2 * r] == r) lowest_ranks.push_back(r);  // ascending, so host numbers ascend with them
    made.host_rank_of_rank_.push_back(places[2 * r + 1]);
  }
  for (int r = 0; r < made.ranks_; ++r) {
    const auto found = std::lower_bound(lowest_ranks.begin(), lowest_ranks.end(), places[2 * r]);
    made.host_of_rank_.push_back(static_cast<int>(found - lowest_ranks.begin()));
  }
  made.host_comm_ = host;
  made.across_comm_ = across;
  made.host_rank_ = host_rank;
  *algorithm = made;
  return Status::OK();
}

std::vector<AllreduceChoice> AllreduceAlgorithm::Alternatives() const {
  if (choice_ != AllreduceChoice::kAuto) return {};
  const bool ring_runs = ring_available_ && hosts_ >= kRingFromHosts;
  std::vector<AllreduceChoice> choices = {AllreduceChoice::kAuto};
  if (ring_runs || hierarchy_available()) choices.push_back(AllreduceChoice::kMpi);
  // Without the hierarchy, at a rank count that is not a power of two, auto already runs ring
  // from 64 KiB: the same calls.
  const bool power_of_two = (ranks_ & (ranks_ - 1)) == 0;
  if (ring_runs && (hierarchy_available() || power_of_two)) choices.push_back(AllreduceChoice::kRing);
  if (hierarchy_available()) choices.push_back(AllreduceChoice::kHierarchical);
  if (choices.size() == 1) choices.clear();
  return choices;
}

std::string AllreduceAlgorithm::Layout() const {
  std::string layout = std::to_string(hosts_) + (hosts_ == 1 ? " host" : " hosts");
  if (ranks_per_host_ > 0) return layout + " x " + std::to_string(ranks_per_host_) + (ranks_per_host_ == 1 ? " rank" : " ranks");
  return layout + " of unequal ranks, " + std::to_string(ranks_) + " in all";
}

std::string AllreduceAlgorithm::Describe() const {
  std::string text = std::string("allreduce algorithm ") + AllreduceChoiceName(choice_) + " on " + Layout() + ": ";
  if (choice_ == AllreduceChoice::kMpi) return text + "MPI's own choice";
  const std::string across = std::string(" (across hosts ") +
                             (UseRingAcross(int64_t{1} << 40) ? "MPICH's ring from " +
                                                                   std::to_string(RingFrom(hosts_) >> 10) + " KiB slices"
                                                              : "MPI's own choice") +
                             ")";
  if (choice_ == AllreduceChoice::kHierarchical && hierarchy_available()) {
    return text + "the hierarchy for every allreduce" + across + " and allgather";
  }
  std::string hierarchy;
  if (choice_ == AllreduceChoice::kAuto && hierarchy_available()) {
    hierarchy = "the hierarchy for calls of at least " + std::to_string(kHierarchyFromBytes >> 10) + " KiB" + across +
                " and allgathers of at least " + std::to_string(kAllgatherHierarchyFromBytes >> 10) + " KiB, below that ";
  } else if (choice_ == AllreduceChoice::kHierarchical) {
    hierarchy = "no hierarchy, since it needs 2 or more hosts of 2 or more ranks each, every host with as many; ";
  }
  if (!ring_available_) {
    return text + hierarchy + "MPI's own choice, since this MPI has no writable " + kVariable + " with a '" +
           kRingItem + "' value (MPICH's)";
  }
  if (choice_ == AllreduceChoice::kRing) return text + "MPICH's ring for every MPI_Allreduce";
  if (hosts_ < kRingFromHosts) {
    return text + hierarchy + "MPI's own choice (fewer than " + std::to_string(kRingFromHosts) + " hosts)";
  }
  return text + hierarchy + "MPICH's ring for calls of at least " + std::to_string(RingFrom(ranks_) >> 10) +
         " KiB, MPI's own choice below";
}

}  // namespace kerasdist
